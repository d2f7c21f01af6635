"""tpot_forecast: a placed request's measured TPOT and prefill stretch against the scheduler's forecast."""

from __future__ import annotations

import pytest

from loadtest.experiments.mixed_steps import ServedRequest
from loadtest.experiments.tpot_forecast import accuracy, forecasts


def _route(t: float, rid: str, kind: str, worker: str | None, tpot_ms: float | None = None,
           stretch_ms: float | None = None, ttft_ms: float | None = None) -> dict:
    return {"t": t, "request": {"request_id": rid, "tier": "enterprise"},
            "decision": {"request_id": rid, "kind": kind, "decode": worker, "predicted_tpot_ms": tpot_ms,
                         "predicted_stretch_ms": stretch_ms, "predicted_ttft_ms": ttft_ms}}


TAP = {
    "routes": [_route(0.0, "a", "route", "w", 120.0, 20.0, 100.0), _route(0.5, "b", "queue", None)],
    # the queued request was placed later: its forecast is that decision's, its TTFT counted from then
    "late_decisions": [{"t": 1.0, "decision": _route(1.0, "b", "route", "w", 100.0, 0.0, 250.0)["decision"]}],
    "samples": {"w": [
        ["decode", 0.3, 2, 200, 0.100], ["decode", 0.6, 2, 202, 0.100], ["decode", 0.9, 2, 204, 0.120],
        # a prompt folded into a step of the two decoding: 0.4 s where a pure step of 2 takes 0.1
        ["mixed", 1.2, 64, 4096, 2, 206, 0.400],
        ["mixed", 5.0, 64, 4096, 2, 300, 0.400],  # after both requests ended
    ]},
}


def test_a_request_is_judged_against_the_decision_that_placed_it_and_the_mixed_steps_of_its_life() -> None:
    served = [ServedRequest("w", 64, 0.0, tuple(0.2 + 0.1 * i for i in range(11))),  # 10 later tokens, 100 ms
              ServedRequest("w", 64, 0.5, (1.5, 1.6, 1.7))]  # starts after the mixed step
    a, b = forecasts(TAP, served, heartbeat_s=0.3)
    assert (a.predicted_tpot_ms, a.predicted_stretch_ms) == (120.0, 20.0)
    assert (a.ttft_ms, a.predicted_ttft_ms) == (pytest.approx(200.0), 100.0)
    assert (b.ttft_ms, b.predicted_ttft_ms) == (pytest.approx(500.0), 250.0)  # placed at 1.0, first token 1.5
    assert a.tpot_ms == pytest.approx(100.0)
    assert a.mixed_excess_ms == pytest.approx(1e3 * (0.400 - 0.100) / 10)  # one mixed step, over 10 tokens
    assert (b.predicted_tpot_ms, b.mixed_excess_ms) == (100.0, 0.0)


def test_the_accuracy_is_the_median_ratio_per_worker_stretch_only_where_one_was_forecast() -> None:
    served = [ServedRequest("w", 64, 0.0, tuple(0.2 + 0.1 * i for i in range(11))),
              ServedRequest("w", 64, 0.5, (1.5, 1.6, 1.7))]
    (w,) = accuracy(forecasts(TAP, served, heartbeat_s=0.3))
    assert w.requests == 2
    assert w.ttft_ratio == pytest.approx(2.0)
    assert w.tpot_ratio == pytest.approx((100 / 120 + 100 / 100) / 2)
    assert w.stretch_ratio == pytest.approx(30.0 / 20.0)  # the second had no stretch forecast
