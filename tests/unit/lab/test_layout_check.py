"""layout_check: the planner's prediction judged on the runs' own rates, as the measurements are."""

from __future__ import annotations

import pytest

from lab.experiments import layout_check
from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import SyntheticLengths, synthetic_trace
from scheduler.planner import Layout, PlanConfig
from scheduler.sim.serving import MEASURED_H100
from scheduler.types import SLO

CARD = WorkerProfile(prefill_fixed_s=0.005, prefill_per_token_s=3.2e-5, decode_fixed_s=0.008, decode_per_seq_s=5e-5)


def _grid(monkeypatch, attainment_by_rate: dict[float, float]) -> float | None:
    """on_the_runs_grid with the simulator's attainment at each rate given (keyed by the scaled rate)."""
    trace = synthetic_trace(SyntheticLengths.parse("64"), SyntheticLengths.parse("8"), 12.0, 20)
    monkeypatch.setattr(layout_check, "scaled_trace", lambda _, factor: factor)
    monkeypatch.setattr(layout_check, "mean_attainment", lambda factor, *_: attainment_by_rate[round(factor * 12)])
    config = PlanConfig(gpus=4, slo=SLO(ttft_ms=500, tpot_ms=50))
    return layout_check.on_the_runs_grid(trace, 12.0, Layout(0, 4), CARD, config, sorted(attainment_by_rate))


def test_the_prediction_on_the_runs_rates_interpolates_the_90_percent_crossing(monkeypatch) -> None:
    # 95% at 24, 40% at 36: the line crosses 90% at 24 + 12 * 0.05 / 0.55 req/s, over 4 GPUs.
    assert _grid(monkeypatch, {12: 1.0, 24: 0.95, 36: 0.4}) == pytest.approx((24 + 12 * 0.05 / 0.55) / 4)


def test_a_layout_missing_the_target_at_the_lowest_rate_has_no_prediction_on_the_grid(monkeypatch) -> None:
    assert _grid(monkeypatch, {12: 0.5, 24: 0.2, 36: 0.1}) is None


def test_the_serving_flags_price_the_simulated_workers_and_keep_the_hand_off_terms(tmp_path) -> None:
    args, _ = layout_check.parse_args("layout_check", None, [
        str(tmp_path), "--out", str(tmp_path / "out"), "--profile", str(tmp_path / "p.json"),
        "--serving-step-ms", "1.55", "--serving-seq-us", "74", "--serving-context-ns", "0"])
    serving = layout_check.serving_cost(args)
    assert (serving.per_step_s, serving.per_seq_s, serving.per_context_token_s) == pytest.approx((1.55e-3, 74e-6, 0.0))
    assert serving.per_prefill_done_s == MEASURED_H100.per_prefill_done_s
    defaults, _ = layout_check.parse_args("layout_check", None, [
        str(tmp_path), "--out", str(tmp_path / "out"), "--profile", str(tmp_path / "p.json")])
    fields = ("per_step_s", "per_seq_s", "per_prefill_step_s", "per_prefill_done_s", "per_context_token_s")
    default = layout_check.serving_cost(defaults)
    assert [getattr(default, f) for f in fields] == pytest.approx([getattr(MEASURED_H100, f) for f in fields])
