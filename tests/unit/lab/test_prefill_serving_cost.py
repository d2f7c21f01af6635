"""lab/experiments/prefill_serving_cost.py: the measured prefill_compute it fits to and the runs it
replays; its two-term fit (scheduler/calibration/prefill_serving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.experiments.prefill_serving_cost import lowest_rate_runs, measured_compute
from scheduler.calibration.prefill_serving import fit_prefill_terms, weighted_least_squares


def test_the_measured_mean_is_count_weighted_over_the_prefill_workers() -> None:
    meta = {"configurations": {"2p2d": {"runs": [{"run": "2p2d__random__r12", "handoff_phases": {
        "prefill-gpu0": {"prefill_compute": {"count": 29, "mean_ms": 141.8}},
        "prefill-gpu1": {"prefill_compute": {"count": 44, "mean_ms": 150.2}},
        "decode-gpu2": {"handoff": {"count": 32}}}}]}}}
    got = measured_compute(meta, "2p2d__random__r12")
    assert got is not None and got.count == 73
    assert got.mean_s == pytest.approx((29 * 141.8 + 44 * 150.2) / 73 / 1e3)
    assert measured_compute(meta, "c4__random__r12") is None  # no prefill workers: nothing to fit


def test_only_each_layout_and_workloads_lowest_rate_is_replayed() -> None:
    runs = [Path(f"{name}.json") for name in ("3p1d__random__r24", "3p1d__random__r12", "3p1d__sharegpt__r40",
                                              "3p1d__sharegpt__r20", "2p2d__random__r36")]
    assert [p.stem for p in lowest_rate_runs(runs)] == ["2p2d__random__r36", "3p1d__random__r12",
                                                        "3p1d__sharegpt__r20"]


def test_two_terms_are_recovered_from_one_step_and_four_step_prompts() -> None:
    # d(mean)/d(per step) = steps per prompt, d(mean)/d(per prompt done) = 1
    steps, done = [1.0, 4.0, 4.0], [1.0, 1.0, 1.0]
    target = [s * 0.008 + d * 0.010 for s, d in zip(steps, done, strict=True)]
    assert weighted_least_squares([steps, done], target, [62, 73, 119]) == pytest.approx((0.008, 0.010))
    # Columns that cannot be told apart: the first term alone
    assert weighted_least_squares([[1.0, 1.0], [1.0, 1.0]], [0.02, 0.02], [1, 1]) == pytest.approx((0.02, 0.0))


def test_gauss_newton_recovers_the_terms_and_clamps_a_negative_one_at_zero() -> None:
    steps = [1.0, 4.0, 4.0]  # a simulator whose mean prefill_compute is base + steps * a + b

    def simulate(terms: tuple[float, float]) -> list[float]:
        return [0.1 + s * terms[0] + terms[1] for s in steps]

    measured = [0.1 + s * 0.008 + 0.010 for s in steps]
    assert fit_prefill_terms(simulate, measured, [62, 73, 119]) == pytest.approx((0.008, 0.010), abs=1e-9)
    faster = [0.1 + s * 0.008 - 0.010 for s in steps]  # a negative per-prompt cost is noise: held at 0
    got = fit_prefill_terms(simulate, faster, [1, 1, 1])
    assert got[1] == 0.0 and got[0] >= 0.0
