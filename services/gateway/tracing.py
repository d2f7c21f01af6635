"""OpenTelemetry for the gateway: spans per request and per generation, W3C trace context into gRPC.

Incoming HTTP requests are traced by the FastAPI instrumentation (it extracts `traceparent`). Calls to
the scheduler and safety carry the current context through their channels' interceptors, calls to
workers through `grpc_trace_metadata` (services/common/tracing.py has both, and the set-up).
"""

from __future__ import annotations

import logging
from functools import partial

from fastapi import FastAPI
from opentelemetry import trace

from services.common import tracing as common

log = logging.getLogger(__name__)
tracer = trace.get_tracer("baton.gateway")
EXPORTERS = common.EXPORTERS
grpc_trace_metadata = common.grpc_trace_metadata
setup_tracing = partial(common.setup_tracing, service_name="baton-gateway")


def instrument_app(app: FastAPI) -> None:
    """Server spans for every route, continuing the caller's `traceparent` (if the package is present)."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:  # optional: the gateway still propagates context to workers without it
        log.info("opentelemetry-instrumentation-fastapi not installed; no HTTP server spans")
        return
    # No per-message spans: a stream would otherwise make one span per SSE chunk.
    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics", exclude_spans=["receive", "send"])
