"""Per-run deltas of the scheduler's, gateway's and engines' metrics (lab/experiments/run_metrics.py)."""

import pytest

from lab.experiments.run_metrics import run_delta

WAIT = "baton_scheduler_queue_wait_seconds"


def _histogram(counts: dict[float, float], total_s: float) -> dict[str, float]:
    out = {f"{WAIT}_bucket{{le={b}}}": c for b, c in counts.items()}
    out[f"{WAIT}_count"] = max(counts.values())
    out[f"{WAIT}_sum"] = total_s
    return out


def test_a_histogram_is_summarised_from_what_the_run_added():
    before = {"scheduler": _histogram({0.1: 5.0, 1.0: 5.0, float("inf"): 5.0}, 0.25)}
    after = {"scheduler": _histogram({0.1: 5.0, 1.0: 15.0, float("inf"): 15.0}, 5.25)}
    row = run_delta(before, after)["scheduler"][WAIT]
    assert row["count"] == 10
    assert row["mean_ms"] == pytest.approx(500.0)
    assert row["p50_ms"] == pytest.approx(550.0)  # half-way through the (0.1, 1.0] bucket, where all ten fell


def test_counters_keep_their_labels_and_unchanged_ones_are_left_out():
    key = "baton_scheduler_decisions_total{kind=queue,reason=slo}"
    other = "baton_scheduler_decisions_total{kind=route,reason=ok}"
    before = {"scheduler": {key: 2.0, other: 7.0}}
    after = {"scheduler": {key: 9.0, other: 7.0}}
    assert run_delta(before, after) == {"scheduler": {key: 7.0}}


def test_a_labelled_histogram_is_one_series_per_label_set():
    step = "baton_engine_step_seconds"
    after = {"both-gpu0": {f"{step}_bucket{{kind=mixed,le=0.05}}": 4.0, f"{step}_bucket{{kind=mixed,le=+Inf}}": 4.0,
                           f"{step}_count{{kind=mixed}}": 4.0, f"{step}_sum{{kind=mixed}}": 0.08}}
    row = run_delta({}, after)["both-gpu0"][f"{step}{{kind=mixed}}"]
    assert row["count"] == 4 and row["mean_ms"] == pytest.approx(20.0)


def test_an_unreachable_process_contributes_nothing():
    assert run_delta({}, {"gateway": {"unreachable": 1.0, "error": "refused"}}) == {"gateway": {"unreachable": 1.0}}
