"""The gateway replay fit's score (scheduler/calibration/replay_score.py, searched by
lab/experiments/gateway_replay_fit.py): log-ratio errors over the runs that served, attainment error, lowest total
first."""

from __future__ import annotations

import math

import pytest

from scheduler.calibration.replay_score import Row, Side, score
from scheduler.sim.gateway import GatewayCost


def _side(attainment: float, ttft_ms: float, tpot_ms: float) -> Side:
    return Side(attainment, ttft_ms, 2 * ttft_ms, tpot_ms, 2 * tpot_ms, refused=0, remote=None)


def test_errors_are_log_ratios_and_collapsed_runs_are_left_out() -> None:
    rows = [
        Row("c4__sharegpt__r20", _side(1.0, 100, 10), _side(0.9, 200, 10)),  # TTFT 2x high, TPOT exact
        Row("c4__sharegpt__r40", _side(0.8, 100, 20), _side(0.8, 50, 40)),  # TTFT 2x low, TPOT 2x high
        Row("c4__sharegpt__r60", _side(0.2, 900, 90), _side(0.9, 1, 1)),  # served too few to judge
    ]
    s = score(GatewayCost(per_token_s=1e-4), rows)
    assert s.runs == 2
    assert s.log_errors["ttft_p50_ms"] == pytest.approx(math.log(2))
    assert s.log_errors["tpot_p90_ms"] == pytest.approx(math.log(2) / 2)
    assert s.total == pytest.approx(3 * math.log(2))
    assert s.attainment_error == pytest.approx(0.05)


def test_a_run_without_percentiles_scores_nothing_for_them() -> None:
    empty = Side(0.0, None, None, None, None, refused=10, remote=None)
    s = score(GatewayCost(), [Row("c4__random__r99", _side(1.0, 100, 10), empty)])
    assert s.runs == 1 and math.isnan(s.log_errors["ttft_p50_ms"])
