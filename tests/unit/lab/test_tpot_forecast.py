"""tpot_forecast: a placed request's measured TPOT and prefill stretch against the scheduler's forecast."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from lab.experiments.mixed_steps import ServedRequest
from lab.experiments.tpot_forecast import accuracy, forecasts, suite_forecasts
from loadtest.metrics import GoodputCriterion
from loadtest.records import RequestRecord
from loadtest.report import BenchResult, write_result
from loadtest.runner import RunResult


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


def _suite_run(out: Path, name: str, created_at: str, prompts: list[int]) -> None:
    """A bench file of requests with these prompt lengths, each 3 tokens 0.1 s apart."""
    records = [RequestRecord(f"{i}-0", i, 0, 0.1 * i, prompt, 3, ok=True, ttft=0.2, chunk_gaps=[0.1, 0.1])
               for i, prompt in enumerate(prompts)]
    write_result(BenchResult(name, {}, GoodputCriterion(500.0, 50.0), [RunResult(1.0, {}, None, records, 10.0)]),
                 out / "runs" / f"{name}.json")
    doc = json.loads((out / "runs" / f"{name}.json").read_text())
    (out / "runs" / f"{name}.json").write_text(json.dumps({**doc, "created_at": created_at}))


def test_a_suite_folder_gives_each_run_the_routes_its_bench_made(tmp_path: Path) -> None:
    # One tap for the layout, two runs 30 s apart of the same lengths: each pairs only with its own routes.
    ends = {"c1__random__r1": "2026-11-29T05:00:10+00:00", "c1__random__r2": "2026-11-29T05:00:40+00:00"}
    for name, created_at in ends.items():
        _suite_run(tmp_path, name, created_at, [64, 64])
    start = datetime(2026, 11, 29, 5, 0, 0, tzinfo=UTC).timestamp()
    routes = [_route(t, f"{t}", "route", "w", tpot_ms, 0.0, 100.0)
              for t, tpot_ms in ((0.5, 100.0), (0.6, 100.0), (30.5, 50.0), (30.6, 50.0))]
    for r in routes:
        r["request"].update(prompt_tokens=64, max_tokens=3)
    tap = {"time_offset_s": start, "routes": routes, "late_decisions": [], "samples": {}}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "c1-scheduler_tap.json").write_text(json.dumps(tap))
    found = suite_forecasts(tmp_path, heartbeat_s=0.2)
    assert {name: [f.predicted_tpot_ms for f in fs] for name, fs in found.items()} == {
        "c1__random__r1": [100.0, 100.0], "c1__random__r2": [50.0, 50.0]}
    (w,) = accuracy(found["c1__random__r2"])
    assert (w.tpot_ratio, w.base_ratio) == (pytest.approx(2.0), pytest.approx(2.0))  # 100 ms measured, no stretch
