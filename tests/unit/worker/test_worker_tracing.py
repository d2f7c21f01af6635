"""A worker's RPCs continue the caller's trace: Generate on a real gRPC worker server (the tiny model)
runs in a SERVER span whose trace is the caller's. Spans are collected in memory in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from handoff_harness import build_engine
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.common.tracing import client_interceptors
from services.worker.config import WorkerConfig, WorkerRole
from services.worker.server import WorkerServer
from tests.support.spans import recorded_spans


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


async def test_generate_continues_the_callers_trace(spans: InMemorySpanExporter, tiny_model_dir: Path) -> None:
    server = WorkerServer(WorkerConfig(role=WorkerRole.BOTH, model_id="tiny", drain_grace_s=0),
                          build_engine(tiny_model_dir))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors()) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            request = pb.GenerateRequest(request_id="traced-1", prompt_token_ids=[3, 4, 5, 6],
                                         sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
            with trace.get_tracer("test").start_as_current_span("caller", kind=SpanKind.SERVER) as caller:
                tokens = [t async for msg in stub.Generate(request) for t in msg.token_ids]
    finally:
        await server.drain()
    assert len(tokens) == 2
    served = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER and "Generate" in s.name]
    assert len(served) == 1, [(s.name, s.kind) for s in spans.get_finished_spans()]
    assert served[0].context.trace_id == caller.get_span_context().trace_id
