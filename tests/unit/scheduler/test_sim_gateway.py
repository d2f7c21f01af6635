"""The gateway's event loop as a simulated round robin over its streams (scheduler/sim/gateway.py) and what it
adds to a replay."""

from __future__ import annotations

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.replay import ReplayConfig, replay
from scheduler.sim.gateway import NO_GATEWAY, GatewayCost, SimGateway, SimGateways
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.types import SLO, Tier, WorkerRole


def test_a_stream_gets_one_token_per_round_of_the_open_streams() -> None:
    gateway = SimGateway(GatewayCost(per_token_s=1e-3))
    outs = [gateway.first_token(0.0) for _ in range(10)]  # ten streams open at once
    assert outs[0] == pytest.approx(0.001)  # an idle loop: the first waits for nothing
    assert outs[-1] == pytest.approx(0.010)  # a burst queues behind itself
    assert gateway.round_s(0.0) == pytest.approx(0.010)
    # Tokens produced every 1 ms go out one per 10-ms round: the loop, not the engine, sets the pace.
    last = outs[0]
    for step in range(1, 4):
        last = gateway.next_token(last, step * 1e-3)
    assert last == pytest.approx(0.031)


def test_a_new_stream_waits_one_round_not_the_whole_backlog() -> None:
    gateway = SimGateway(GatewayCost(per_token_s=1e-3))
    for _ in range(10):
        gateway.first_token(0.0)
    for _ in range(500):  # 0.5 s of tokens queued behind the ten streams
        gateway.next_token(0.0, 0.0)
    assert gateway.first_token(0.0) == pytest.approx(0.0 + 0.010 + 0.001)


def test_closed_streams_leave_the_round_when_their_last_token_is_out() -> None:
    gateway = SimGateway(GatewayCost(per_token_s=1e-3))
    for _ in range(4):
        gateway.first_token(0.0)
    gateway.close(0.5)
    assert gateway.round_s(0.4) == pytest.approx(0.004)
    assert gateway.round_s(0.5) == pytest.approx(0.003)


def test_arrivals_stretch_the_round_and_wait_rounds_on_their_way_in() -> None:
    gateway = SimGateway(GatewayCost(per_request_s=0.01, per_token_s=1e-3, admission_rounds=2.0))
    for _ in range(10):
        gateway.first_token(0.0)
    assert gateway.admit(1.0) == pytest.approx(1.0 + 2 * 0.010 / 0.99 + 0.01)  # its own 1% of the loop
    for t in range(49):
        gateway.admit(1.0 + t * 1e-3)
    assert gateway.round_s(1.05) == pytest.approx(0.010 / 0.5)  # 50 arrivals a second x 10 ms: half the loop


def test_negative_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        GatewayCost(per_token_s=-1e-6)
    with pytest.raises(ValueError, match="at least one process"):
        GatewayCost(per_token_s=1e-6, processes=0)
    assert NO_GATEWAY.free and not GatewayCost(per_token_s=1e-6).free


def test_processes_split_the_streams_and_keep_each_request_on_one_loop() -> None:
    gateways = SimGateways(GatewayCost(per_token_s=1e-3, processes=4))
    ids = [f"r{i}" for i in range(400)]
    loops = [gateways.of(rid) for rid in ids]
    assert all(gateways.of(rid) is loop for rid, loop in zip(ids, loops, strict=True))  # sticky, as a connection
    for loop in loops:
        loop.first_token(0.0)
    # 400 streams over 4 loops: each round covers about a quarter of them (a hash spreads them, not evenly).
    rounds = [loop.round_s(0.0) for loop in gateways.loops]
    assert sum(rounds) == pytest.approx(0.400)
    assert all(0.07 < r < 0.13 for r in rounds), rounds
    assert SimGateways(GatewayCost(per_token_s=1e-3)).of("any") is not None


def test_more_processes_cut_a_saturated_gateways_first_token_delay() -> None:
    one = GatewayCost(per_request_s=0.001, per_token_s=0.002)
    four = GatewayCost(per_request_s=0.001, per_token_s=0.002, processes=4)
    base = _ttft_p50_ms(NO_GATEWAY, 40, 0.01)
    assert _ttft_p50_ms(four, 40, 0.01) - base < 0.5 * (_ttft_p50_ms(one, 40, 0.01) - base)


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
