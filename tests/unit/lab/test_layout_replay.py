"""lab/experiments/layout_replay.py: the measured side of a run and the planner layout it maps to."""

from __future__ import annotations

import pytest

from lab.experiments.layout_check import run_seed
from lab.experiments.layout_replay import measured_remote, measured_side, planner_layout
from loadtest.records import RequestRecord
from scheduler.planner import Layout
from scheduler.types import SLO


def _record(ttft: float, tpot: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(request_id="r", session_id=0, turn=0, send_time=0.0, prompt_len=100, max_tokens=11, ok=ok,
                         ttft=ttft if ok else None, e2e=ttft + 10 * tpot if ok else None, output_tokens=11 if ok else 0)


def test_run_names_map_to_planner_layouts() -> None:
    assert planner_layout("c4") == Layout(0, 4)
    assert planner_layout("3p1d") == Layout(3, 1)
    with pytest.raises(ValueError, match="unknown layout"):
        planner_layout("4x")


def test_the_measured_side_counts_failures_as_misses_and_refusals() -> None:
    records = [_record(0.1, 0.02), _record(0.6, 0.02), _record(0.1, 0.06), _record(0.0, 0.0, ok=False)]
    side = measured_side(records, SLO(500, 50), remote=None)
    assert side.attainment == 0.25
    assert side.refused == 1
    assert side.ttft_p50_ms == pytest.approx(100.0)
    assert side.tpot_p90_ms == pytest.approx(52.0)


def test_remote_prefills_are_the_decode_workers_hand_offs_of_that_run() -> None:
    meta = {"configurations": {"2p2d": {"runs": [
        {"run": "2p2d__random__r12", "handoff_phases": {
            "decode-gpu2": {"handoff": {"count": 32}}, "decode-gpu3": {"handoff": {"count": 41}},
            "prefill-gpu0": {"prefill_compute": {"count": 29}}}}]}}}
    assert measured_remote(meta, "2p2d__random__r12") == 73
    assert measured_remote(meta, "2p2d__random__r24") is None


def test_the_runs_own_scheduler_seed_is_read_from_their_summary() -> None:
    meta = {"scheduler_profile": {"Llama-3.1-8B-dummy": {"prefill_fixed_s": 0.0193, "decode_fixed_s": 0.0087}}}
    assert run_seed(meta).prefill_fixed_s == 0.0193
    with pytest.raises(ValueError, match="no scheduler_profile"):
        run_seed({})
