"""`create_app(deps)`: the gateway's FastAPI application.

Routes are thin (routes/*); what they need comes from `deps` through typed dependencies (deps.py);
typed errors become OpenAI error JSON (errors.py). The lifespan starts the dependencies and the
conversation purge loop, and on shutdown drains: running streams get `drain_timeout_s` to finish
before they are aborted (their KV freed and their usage billed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.adapters.loop_watch import GcPauses, watch_loop
from services.gateway.deps import GatewayDeps
from services.gateway.errors import install_error_handlers
from services.gateway.limits import BodySizeLimit
from services.gateway.metrics import GatewayMetrics
from services.gateway.routes import completions, conversations, health, models, moderations, page, responses, usage
from services.gateway.routes.page import STATIC_DIR
from services.gateway.tenancy.retention import run_purge_loop
from services.gateway.tracing import instrument_app

if TYPE_CHECKING:
    from services.gateway.grpc_api.server import GrpcApiServer

API_VERSION = "0.1.0"


class RequestMetricsMiddleware:
    """Counts requests by route template and status, and times them to the response head (pure ASGI,
    so streaming responses and disconnect detection are untouched); adds `headers` to every response
    head (the one wrapper every streamed chunk already crosses)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.headers = list(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                route = scope.get("route")
                self.metrics.request_seconds.labels(getattr(route, "path", "unmatched")).observe(
                    time.monotonic() - started)
                if self.headers:
                    message = {**message, "headers": [*message.get("headers", ()), *self.headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), scope["method"], str(status)).inc()


def create_app(deps: GatewayDeps, grpc_api: GrpcApiServer | None = None, replica: int | None = None) -> FastAPI:
    """`grpc_api`: the internal gRPC API, served from the same clients while the app runs. `replica`:
    this process's number among several gateway processes on the port (None: the only one)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await deps.start()
        if grpc_api is not None:
            await grpc_api.start()
        store = deps.tenancy.conversations
        purge = None if store is None else asyncio.create_task(run_purge_loop(
            store, timedelta(days=deps.config.retention_days), deps.config.purge_interval_s))
        gc_pauses = GcPauses("gateway", deps.metrics.gc_pause)
        watch = asyncio.create_task(watch_loop("gateway", deps.metrics.loop_lag, cpu=deps.metrics.loop_cpu,
                                               gc_pauses=gc_pauses))
        try:
            yield
        finally:
            gc_pauses.stop()
            if grpc_api is not None:
                await grpc_api.stop(deps.config.drain_timeout_s)
            for task in (purge, watch):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await deps.close()

    app = FastAPI(title="Baton", version=API_VERSION, lifespan=lifespan,
                  description="OpenAI-compatible gateway of a disaggregated prefill/decode cluster")
    app.state.deps = deps
    install_error_handlers(app)
    for module in (completions, responses, models, conversations, moderations, usage, health, page):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(BodySizeLimit, max_bytes=deps.config.max_request_bytes)
    # Several processes on the port (replicas.py): each response names the one that answered, which a
    # resume or a log search needs to know (added with the response head, no extra wrapper per chunk).
    replica_header = () if replica is None else ((b"x-baton-gateway-replica", str(replica).encode()),)
    app.add_middleware(RequestMetricsMiddleware, metrics=deps.metrics, headers=replica_header)
    instrument_app(app)
    return app
