"""OpenTelemetry for the gateway: spans per request and per generation, W3C trace context into gRPC.

Incoming HTTP requests are traced by the FastAPI instrumentation (it extracts `traceparent`), and every
call to a worker carries the current context in its gRPC metadata (`grpc_trace_metadata`), injected
by the globally configured propagator (W3C tracecontext + baggage by default). Without a configured
`TracerProvider` the API is a no-op: nothing is recorded and the metadata is empty, at no cost.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from services.common.errors import ConfigError

log = logging.getLogger(__name__)
tracer = trace.get_tracer("baton.gateway")
EXPORTERS = ("none", "console", "otlp")


def grpc_trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata (`traceparent`, `tracestate`); empty when untraced."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def _exporter(name: str) -> SpanExporter | None:
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ConfigError("BATON_OTEL_EXPORTER=otlp needs pip opentelemetry-exporter-otlp") from e
        return OTLPSpanExporter()  # type: ignore[no-any-return]
    raise ConfigError(f"BATON_OTEL_EXPORTER must be one of {list(EXPORTERS)}, got {name!r}")


def setup_tracing(exporter: str, service_name: str = "baton-gateway") -> TracerProvider:
    """Install a global TracerProvider (called once, from main). Spans are always created, so trace
    context flows to the workers even when nothing is exported here."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    chosen = _exporter(exporter)
    if chosen is not None:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    trace.set_tracer_provider(provider)
    return provider


def instrument_app(app: FastAPI) -> None:
    """Server spans for every route, continuing the caller's `traceparent` (if the package is present)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:  # optional: the gateway still propagates context to workers without it
        log.info("opentelemetry-instrumentation-fastapi not installed; no HTTP server spans")
        return
    # No per-message spans: a stream would otherwise make one span per SSE chunk.
    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics", exclude_spans=["receive", "send"])
