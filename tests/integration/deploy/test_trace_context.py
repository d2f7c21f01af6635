"""One request, one trace: the gateway's Route call to a real scheduler gRPC server carries W3C trace
context (client interceptor), and the scheduler's span continues the gateway's trace (server
interceptor), with the routing decision on it. Spans are collected in memory in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from scheduler.types import SLO, RequestSummary, Tier
from services.common.tracing import traced
from services.gateway.routing.router_client import RouterClient
from tests.support.spans import recorded_spans

ROUTE = "baton.v1.Scheduler/Route"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerService]:
    service = SchedulerService(SchedulerServiceConfig(host="127.0.0.1", port=0, drain_grace_s=0))
    await service.start()
    yield service
    await service.stop()


def _summary(request_id: str) -> RequestSummary:
    return RequestSummary(request_id=request_id, num_prompt_tokens=32, prefix_hashes=(), tier=Tier.ENTERPRISE,
                          slo=SLO(ttft_ms=5_000, tpot_ms=250), max_tokens=16)


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


async def test_route_call_continues_the_gateway_trace(spans: InMemorySpanExporter,
                                                      scheduler: SchedulerService) -> None:
    router = RouterClient(f"127.0.0.1:{scheduler.port}", None)
    try:
        with trace.get_tracer("test").start_as_current_span("POST /v1/chat/completions", kind=SpanKind.SERVER):
            decision = await router.route(_summary("req-traced"))
    finally:
        await router.close()
    finished = list(spans.get_finished_spans())
    root = _one(finished, "POST /v1/chat/completions", SpanKind.SERVER)
    client = _one(finished, ROUTE, SpanKind.CLIENT)
    server = _one(finished, ROUTE, SpanKind.SERVER)
    assert {client.context.trace_id, server.context.trace_id} == {root.context.trace_id}
    assert client.parent is not None and client.parent.span_id == root.context.span_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote
    assert server.attributes is not None
    assert server.attributes["baton.request_id"] == "req-traced"
    assert server.attributes["baton.route.kind"] == decision.kind.value  # no workers: a reject


async def test_an_untraced_caller_starts_a_new_trace_at_the_scheduler(spans: InMemorySpanExporter,
                                                                      scheduler: SchedulerService) -> None:
    router = RouterClient(f"127.0.0.1:{scheduler.port}", None)
    try:
        await router.route(_summary("req-root"))
    finally:
        await router.close()
    finished = list(spans.get_finished_spans())
    client = _one(finished, ROUTE, SpanKind.CLIENT)
    server = _one(finished, ROUTE, SpanKind.SERVER)
    assert client.parent is None
    assert server.parent is not None and server.parent.span_id == client.context.span_id


async def test_traced_wraps_sync_and_async_functions_in_a_span(spans: InMemorySpanExporter) -> None:
    @traced("billing.write_batch")
    def write(n: int) -> int:
        return n + 1

    @traced("safety.check")
    async def check(n: int) -> int:
        return n * 2

    assert write(1) == 2 and await check(2) == 4
    assert [s.name for s in spans.get_finished_spans()] == ["billing.write_batch", "safety.check"]
