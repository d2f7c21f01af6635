"""The gateway's event loop as a simulated queue (scheduler/sim/gateway.py) and what it adds to a replay."""

from __future__ import annotations

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.replay import ReplayConfig, replay
from scheduler.sim.gateway import NO_GATEWAY, GatewayCost, SimGateway
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorkerSpec
from scheduler.types import SLO, Tier, WorkerRole


def test_work_queues_first_come_first_served() -> None:
    gateway = SimGateway(GatewayCost(per_request_s=0.002, per_token_s=1e-4))
    assert gateway.admit(0.0) == pytest.approx(0.002)
    assert gateway.stream(0.0, 10) == pytest.approx(0.003)  # behind the request's admission
    assert gateway.stream(1.0, 0) == 1.0  # nothing to stream: no wait
    assert gateway.stream(1.0, 1) == pytest.approx(1.0001)  # an idle loop starts at once


def test_negative_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        GatewayCost(per_token_s=-1e-6)
    assert NO_GATEWAY.free and not GatewayCost(per_token_s=1e-6).free


def _trace(requests: int, gap_s: float) -> list[Arrival]:
    return [Arrival(i * gap_s, f"r{i}", 64, 16, extend_chain((), 4, label=i), Tier.FREE) for i in range(requests)]


def _ttft_p50_ms(gateway: GatewayCost, requests: int, gap_s: float) -> float:
    worker = SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile())
    result = replay(_trace(requests, gap_s), [worker], "least_loaded", SLO(10_000, 1_000),
                    ReplayConfig(step_noise=0.0, gateway=gateway))
    ttft = result.percentile_ms("ttft_s", 50)
    assert ttft is not None
    return ttft


def test_one_request_waits_for_its_own_admission_and_first_token_only() -> None:
    cost = GatewayCost(per_request_s=0.002, per_token_s=0.001)
    assert _ttft_p50_ms(cost, 1, 1.0) == pytest.approx(_ttft_p50_ms(NO_GATEWAY, 1, 1.0) + 2.0 + 1.0, abs=0.01)


def test_a_busy_gateway_delays_first_tokens_more_as_the_token_rate_grows() -> None:
    cost = GatewayCost(per_request_s=0.001, per_token_s=0.002)
    idle = _ttft_p50_ms(cost, 40, 1.0) - _ttft_p50_ms(NO_GATEWAY, 40, 1.0)
    busy = _ttft_p50_ms(cost, 40, 0.01) - _ttft_p50_ms(NO_GATEWAY, 40, 0.01)
    assert idle == pytest.approx(3.0, abs=0.01)
    assert busy > 2 * idle
