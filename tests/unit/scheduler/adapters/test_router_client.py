"""The gateway's RouterClient: static routing, scheduler answers, queued waits, and falling back to
its last view when the scheduler hangs. (Killing and restarting a real scheduler process is in
tests/integration/scheduler.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from scheduler_harness import StartCluster, address

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler.types import SLO, RequestSummary, Tier, WorkerFailure
from services.gateway.routing.last_view import StaticWorkers
from services.gateway.routing.router_client import (
    RouteKind,
    RouterClient,
    RouterConfig,
    RouteSource,
    RoutingError,
)


def summary(request_id: str, prompt: int = 64, ttft_ms: float = 2000) -> RequestSummary:
    return RequestSummary(request_id, prompt, tuple(range(prompt // 16)), Tier.FREE, SLO(ttft_ms, 100), 32)


async def test_static_routing_takes_decode_workers_in_turn() -> None:
    client = RouterClient(None, static_workers=StaticWorkers(decode=("a:1", "b:1")))
    decisions = [await client.route(summary(f"r{i}")) for i in range(4)]
    assert [d.decode_address for d in decisions] == ["a:1", "b:1", "a:1", "b:1"]
    assert {(d.kind, d.source, d.prefill_address, d.max_tokens) for d in decisions} == {
        (RouteKind.ROUTE, RouteSource.STATIC, None, 32)
    }
    await client.close()


async def test_static_routing_prefills_long_prompts_on_the_static_prefill_worker() -> None:
    client = RouterClient(None, static_workers=StaticWorkers(decode=("d:1",), prefill=("p:1",)))
    assert (await client.route(summary("long", prompt=1024))).prefill_address == "p:1"
    assert (await client.route(summary("short", prompt=64))).prefill_address is None
    await client.close()


async def test_a_finished_request_frees_its_static_worker_for_the_next() -> None:
    client = RouterClient(None, static_workers=StaticWorkers(decode=("a:1", "b:1")))
    assert (await client.route(summary("r0"))).decode_address == "a:1"
    assert (await client.route(summary("r1"))).decode_address == "b:1"
    await client.finished("r0")
    assert (await client.route(summary("r2"))).decode_address == "a:1"
    await client.close()


def test_a_client_needs_a_scheduler_or_static_workers() -> None:
    with pytest.raises(ValueError, match="scheduler address, static workers"):
        RouterClient(None)


async def test_the_scheduler_answers_with_addresses_and_its_workers_become_the_view(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    await cluster.register("b")
    client = RouterClient(cluster.address)
    decision = await client.route(summary("r0"))
    assert (decision.source, decision.kind, decision.decode_address) == (
        RouteSource.SCHEDULER, RouteKind.ROUTE, address("a"),
    )
    assert decision.predicted_ttft_ms is not None and decision.reason == "round_robin"
    assert await client.refresh_view()
    assert sorted(w.address for w in client.view.workers) == [address("a"), address("b")]
    await client.close()


async def test_start_connects_and_takes_the_workers_before_the_first_request(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    client = RouterClient(cluster.address)
    await client.start()
    assert [w.address for w in client.view.workers] == [address("a")]
    assert client.scheduler_available
    await client.close()


async def test_start_without_a_scheduler_gives_up_after_its_timeout_and_routing_goes_on() -> None:
    static = StaticWorkers(decode=("a:1",))
    client = RouterClient("127.0.0.1:1", static_workers=static, config=RouterConfig(connect_timeout_s=0.3))
    started = time.monotonic()
    await client.start()  # nothing listens on port 1: a warning, no error
    assert 0.25 < time.monotonic() - started < 2.0
    decision = await client.route(summary("r0"))
    assert (decision.source, decision.decode_address) == (RouteSource.LAST_VIEW, "a:1")
    await client.close()


async def test_a_lost_worker_reported_by_one_gateway_is_avoided_by_every_gateway(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    await cluster.register("b")
    reporter, other = RouterClient(cluster.address), RouterClient(cluster.address)
    reporter.report_lost(address("a"), WorkerFailure.UNAVAILABLE, "connection refused")
    reporter.report_lost(address("a"), WorkerFailure.STREAM_BROKEN)  # the same loss seen twice: one report
    await cluster.until(lambda: cluster.service.scheduler.is_failed("a"))
    decisions = [await other.route(summary(f"r{i}")) for i in range(3)]
    assert {(d.source, d.decode_address) for d in decisions} == {(RouteSource.SCHEDULER, address("b"))}
    assert await other.refresh_view()
    assert [w.address for w in other.view.workers] == [address("b")]  # its fallback view drops it too
    reports = cluster.service.metrics.failure_reports
    assert reports.labels("unavailable", "marked")._value.get() == 1
    assert reports.labels("stream_broken", "marked")._value.get() == 0
    await reporter.close()
    await other.close()


async def test_a_queued_request_waits_past_the_call_timeout_for_its_placement(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    client = RouterClient(cluster.address, config=RouterConfig(call_timeout_s=0.2))
    routing = asyncio.create_task(client.route(summary("r", prompt=512, ttft_ms=5000)))
    await cluster.until(lambda: cluster.service.scheduler.queued == 1)
    await asyncio.sleep(0.4)  # longer than the call timeout: the QUEUE message keeps it waiting
    cluster.clock.advance(0.5)
    await cluster.heartbeat("w", free_blocks=40)
    decision = await routing
    assert (decision.source, decision.kind, decision.decode_address) == (
        RouteSource.SCHEDULER, RouteKind.ROUTE, address("w"),
    )
    assert client.scheduler_available
    await client.close()


async def test_a_duplicate_queued_request_is_a_routing_error_not_an_outage(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    client = RouterClient(cluster.address)
    first = asyncio.create_task(client.route(summary("same", prompt=512, ttft_ms=5000)))
    await cluster.until(lambda: cluster.service.scheduler.queued == 1)
    with pytest.raises(RoutingError, match="already queued"):
        await client.route(summary("same", prompt=512, ttft_ms=5000))
    assert client.scheduler_available
    first.cancel()
    await cluster.until(lambda: cluster.service.scheduler.queued == 0)  # cancelling left the queue
    await client.close()


class _HungScheduler(pb_grpc.SchedulerServicer):
    """Accepts connections and calls but never answers a Route: a stuck scheduler process."""

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> None:
        await asyncio.sleep(30)


@pytest.fixture
async def hung_scheduler() -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(_HungScheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def test_a_hung_scheduler_costs_one_call_timeout_then_the_last_view_routes(hung_scheduler: str) -> None:
    static = StaticWorkers(decode=("a:1", "b:1"))
    client = RouterClient(hung_scheduler, static_workers=static, config=RouterConfig(call_timeout_s=0.2))
    started = time.monotonic()
    first = await client.route(summary("r0"))
    assert 0.15 < time.monotonic() - started < 1.0
    assert (first.source, first.decode_address) == (RouteSource.LAST_VIEW, "a:1")
    assert not client.scheduler_available
    started = time.monotonic()
    second = await client.route(summary("r1"))  # within the retry interval: no second timeout
    assert time.monotonic() - started < 0.1
    assert (second.source, second.decode_address) == (RouteSource.LAST_VIEW, "b:1")
    await client.close()


async def test_with_no_view_an_unreachable_scheduler_means_retry_later() -> None:
    client = RouterClient("127.0.0.1:1")  # nothing listens on port 1
    decision = await client.route(summary("r"))
    assert (decision.kind, decision.source, decision.reason) == (
        RouteKind.REJECT, RouteSource.LAST_VIEW, "no_live_worker_for_model",
    )
    assert decision.retry_after_s is not None
    await client.close()


class _SlowOnceScheduler(pb_grpc.SchedulerServicer):
    """Answers the first Route after 0.6 s (one late answer) and every later one after 0.15 s."""

    def __init__(self) -> None:
        self.calls = 0

    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouteResponse]:
        self.calls += 1
        await asyncio.sleep(0.6 if self.calls == 1 else 0.15)
        yield pb.RouteResponse(kind=pb.RouteResponse.KIND_ROUTE, decode_worker="s:1")

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse()

    async def Finished(self, request: pb.FinishedRequest, context: grpc.aio.ServicerContext) -> pb.FinishedResponse:
        return pb.FinishedResponse()


async def test_an_answer_to_a_call_in_flight_ends_the_fallback_at_once() -> None:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(_SlowOnceScheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RouterClient(f"127.0.0.1:{port}", static_workers=StaticWorkers(decode=("a:1",)),
                          config=RouterConfig(call_timeout_s=0.2, retry_scheduler_after_s=30.0))
    try:
        late = asyncio.create_task(client.route(summary("late")))
        await asyncio.sleep(0.1)
        # Asked before the first call times out (at 0.2 s), answered after it (at ~0.25 s).
        in_flight = asyncio.create_task(client.route(summary("in-flight")))
        assert (await late).source is RouteSource.LAST_VIEW
        assert not client.scheduler_available
        assert (await in_flight).source is RouteSource.SCHEDULER
        # The scheduler answered, so the next request asks it again instead of waiting out 30 s.
        assert client.scheduler_available
        assert (await client.route(summary("next"))).decode_address == "s:1"
    finally:
        await client.close()
        await server.stop(0)
