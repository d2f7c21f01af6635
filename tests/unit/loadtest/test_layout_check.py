"""layout_check: the planner's prediction judged on the runs' own rates, as the measurements are."""

from __future__ import annotations

import pytest

from loadtest.experiments import layout_check
from scheduler.core.cost_model import WorkerProfile
from scheduler.planner import Layout, LengthDistribution, PlanConfig, synthetic_trace
from scheduler.types import SLO

CARD = WorkerProfile(prefill_fixed_s=0.005, prefill_per_token_s=3.2e-5, decode_fixed_s=0.008, decode_per_seq_s=5e-5)


def _grid(monkeypatch, attainment_by_rate: dict[float, float]) -> float | None:
    """on_the_runs_grid with the simulator's attainment at each rate given (keyed by the scaled rate)."""
    trace = synthetic_trace(LengthDistribution.parse("64"), LengthDistribution.parse("8"), 12.0, 20)
    monkeypatch.setattr(layout_check, "scaled_trace", lambda _, factor: factor)
    monkeypatch.setattr(layout_check, "mean_attainment", lambda factor, *_: attainment_by_rate[round(factor * 12)])
    config = PlanConfig(gpus=4, slo=SLO(ttft_ms=500, tpot_ms=50))
    return layout_check.on_the_runs_grid(trace, 12.0, Layout(0, 4), CARD, config, sorted(attainment_by_rate))


def test_the_prediction_on_the_runs_rates_interpolates_the_90_percent_crossing(monkeypatch) -> None:
    # 95% at 24, 40% at 36: the line crosses 90% at 24 + 12 * 0.05 / 0.55 req/s, over 4 GPUs.
    assert _grid(monkeypatch, {12: 1.0, 24: 0.95, 36: 0.4}) == pytest.approx((24 + 12 * 0.05 / 0.55) / 4)


def test_a_layout_missing_the_target_at_the_lowest_rate_has_no_prediction_on_the_grid(monkeypatch) -> None:
    assert _grid(monkeypatch, {12: 0.5, 24: 0.2, 36: 0.1}) is None
