"""The attention sweep's recommendation (lab/micro/sweep_choice.py) from hand-made measured rows."""

from __future__ import annotations

from lab.micro.sweep_choice import SweepRow, mark_baseline, recommend

BASE, FAST, FASTER = "DecodeConfig(base)", "DecodeConfig(fast)", "DecodeConfig(faster)"
SHAPE = "(DecodeBatch.FEW, ContextLength.LONG)"


def case_rows(case: str, timings: dict[str, float], errors: dict[str, float] | None = None) -> list[SweepRow]:
    rows = [SweepRow("decode", case, SHAPE, "sdpa", "", ms=1.0)]
    rows += [SweepRow("decode", case, SHAPE, config, config, ms=ms, err=(errors or {}).get(config, 1e-3))
             for config, ms in timings.items()]
    mark_baseline(rows, BASE)
    return rows


def test_speed_up_is_measured_against_the_baseline_of_the_same_case() -> None:
    rows = case_rows("B=1", {BASE: 2.0, FAST: 1.0})
    assert [r.vs_baseline for r in rows] == [2.0, 1.0, 2.0]


def test_the_best_geometric_mean_over_the_class_is_recommended_as_a_table_line() -> None:
    rows = case_rows("B=1", {BASE: 2.0, FAST: 1.0, FASTER: 0.5}) + case_rows("B=8", {BASE: 2.0, FAST: 1.0,
                                                                                      FASTER: 1.6})
    assert recommend(rows) == ["# decode ['B=1', 'B=8']: x2.24 over the baseline (DECODE_TABLE)",
                               f"    {SHAPE}: {FASTER},"]


def test_a_config_slower_than_the_baseline_on_any_case_is_not_recommended() -> None:
    rows = case_rows("B=1", {BASE: 2.0, FAST: 1.0, FASTER: 0.2}) + case_rows("B=8", {BASE: 2.0, FAST: 1.5,
                                                                                      FASTER: 2.2})
    assert recommend(rows)[1] == f"    {SHAPE}: {FAST},"


def test_a_wrong_or_failed_config_is_never_recommended() -> None:
    rows = case_rows("B=1", {BASE: 2.0, FAST: 1.0, FASTER: 0.5}, errors={FASTER: 0.5})
    rows += [SweepRow("decode", "B=1", SHAPE, "broken", "DecodeConfig(broken)", error="OutOfResources")]
    assert recommend(rows)[1] == f"    {SHAPE}: {FAST},"


def test_a_config_missing_from_a_case_of_the_class_is_not_recommended() -> None:
    rows = case_rows("B=1", {BASE: 2.0, FAST: 1.5, FASTER: 0.5}) + case_rows("B=8", {BASE: 2.0, FAST: 1.5})
    assert recommend(rows)[1] == f"    {SHAPE}: {FAST},"


def test_mixed_steps_recommend_where_the_decode_rows_run() -> None:
    modes = (("DecodeRows.INLINE", 1.5), ("DecodeRows.PREFILL_TILES", 2.0), ("DecodeRows.DECODE_KERNEL", 1.0))
    rows = [SweepRow("mixed", "mix", "PrefillRows.LARGE", mode, BASE, decode_rows=mode, ms=ms, err=1e-3)
            for mode, ms in modes]
    mark_baseline(rows, BASE)
    assert [r.vs_baseline for r in rows] == [2.0 / 1.5, 1.0, 2.0]  # against the pre-sweep mode
    assert recommend(rows)[1] == f"MIXED_DECODE_ROWS = DecodeRows.DECODE_KERNEL  # with {BASE}"
