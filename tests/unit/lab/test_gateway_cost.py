"""Fitting the gateway's loop cost per request and per streamed token (scheduler/calibration/gateway.py) from
layout runs' service metrics (lab/experiments/gateway_cost.py)."""

from __future__ import annotations

import pytest

from lab.experiments.gateway_cost import FINISHED, LOOP_CPU, MESSAGES, TOKENS, gateway_runs
from scheduler.calibration.gateway import fit_gateway_cost
from scheduler.sim.gateway import MEASURED_GATEWAY

MODEL = "model=Llama-3.1-8B-dummy"


def summary(*runs: tuple[str, int, int, float | None]) -> dict:
    """A layouts_suite summary.json with one configuration's runs: (name, requests, tokens, loop CPU s)."""
    entries = []
    for name, requests, tokens, cpu in runs:
        gateway = {f"{FINISHED}{{finish_reason=length,{MODEL}}}": float(requests),
                   f"{TOKENS}{{kind=completion,{MODEL}}}": float(tokens),
                   f"{TOKENS}{{kind=prompt,{MODEL}}}": 1000.0 * requests}
        if cpu is not None:
            gateway[LOOP_CPU] = cpu
        entries.append({"run": name, "service_metrics": {"gateway": gateway, "scheduler": {}}})
    return {"configurations": {"c4": {"runs": entries}}}


def cpu_of(requests: int, tokens: int, request_s: float = 0.002, token_s: float = 70e-6) -> float:
    return requests * request_s + tokens * token_s


def test_two_workloads_separate_the_per_request_and_per_token_costs() -> None:
    runs = gateway_runs(summary(("c4__random__r30", 450, 450 * 128, cpu_of(450, 450 * 128)),
                                ("c4__sharegpt__r40", 600, 600 * 275, cpu_of(600, 600 * 275)),
                                ("c4__sharegpt__r20", 300, 300 * 260, cpu_of(300, 300 * 260))))
    result = fit_gateway_cost(runs)
    assert result.both_fitted
    assert result.cost.per_request_s == pytest.approx(0.002, rel=1e-6)
    assert result.cost.per_token_s == pytest.approx(70e-6, rel=1e-6)
    assert result.flags() == "--gateway-request-ms 2 --gateway-token-us 70"


def test_one_workload_holds_the_per_request_cost_and_fits_the_per_token_one() -> None:
    runs = gateway_runs(summary(("c4__sharegpt__r34", 500, 500 * 275, cpu_of(500, 500 * 275, request_s=0.003)),
                                ("1p3d__sharegpt__r40", 600, 600 * 270, cpu_of(600, 600 * 270, request_s=0.003))))
    result = fit_gateway_cost(runs, request_s=0.003)
    assert not result.both_fitted
    assert result.cost.per_request_s == 0.003
    assert result.cost.per_token_s == pytest.approx(70e-6, rel=1e-6)


def test_a_cost_the_runs_say_is_negative_is_pinned_at_zero() -> None:
    runs = gateway_runs(summary(("a", 100, 10_000, 1.0), ("b", 100, 30_000, 0.9)))  # more tokens, less CPU
    result = fit_gateway_cost(runs)
    assert result.cost.per_request_s >= 0.0 and result.cost.per_token_s >= 0.0


def test_runs_without_the_loop_cpu_cannot_be_fitted() -> None:
    runs = gateway_runs(summary(("old", 450, 450 * 128, None)))
    assert runs == []
    with pytest.raises(ValueError, match="loop CPU"):
        fit_gateway_cost(runs, MEASURED_GATEWAY.per_request_s)


def test_the_worker_messages_are_read_when_the_gateway_counted_them() -> None:
    data = summary(("new", 450, 450 * 128, 5.0), ("old", 450, 450 * 128, 5.0))
    data["configurations"]["c4"]["runs"][0]["service_metrics"]["gateway"][MESSAGES] = 450 * 32.0  # 4 tokens each
    new, old = gateway_runs(data)
    assert new.worker_messages == 450 * 32 and old.worker_messages is None
