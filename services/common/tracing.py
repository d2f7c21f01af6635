"""OpenTelemetry for every Baton service: the tracer set-up, W3C trace context over gRPC, span helpers.

One request is one trace across processes: the gateway's HTTP server span is the root, and every gRPC
hop carries the current context in its metadata (`traceparent`, `tracestate`: the globally configured
propagator, W3C tracecontext + baggage by default). Clients add `TraceContextClientInterceptor`s to
their channel (`grpc.aio.insecure_channel(addr, interceptors=client_interceptors())`): each call gets
a CLIENT span and its context in the metadata. Servers add `TraceContextServerInterceptor` to
`grpc.aio.server(interceptors=[...])`: each call runs inside a SERVER span whose parent is the
caller's context (gRPC health checks are not traced).

Without a configured `TracerProvider` the API is a no-op: nothing is recorded, the metadata is empty,
at no cost. Each service's main calls `setup_tracing(exporter, service_name)` once; the OTLP exporter
reads the standard `OTEL_EXPORTER_OTLP_*` variables (endpoint, headers) itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind

from services.common.errors import ConfigError

EXPORTERS = ("none", "console", "otlp")
_UNTRACED_PREFIX = "/grpc.health."
tracer = trace.get_tracer("baton")
_F = TypeVar("_F", bound=Callable[..., Any])


def make_exporter(name: str) -> SpanExporter | None:
    """The span exporter named by `BATON_OTEL_EXPORTER` / `--otel-exporter`; None for "none"."""
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ConfigError("otel exporter 'otlp' needs pip opentelemetry-exporter-otlp-proto-grpc") from e
        return OTLPSpanExporter()  # type: ignore[no-any-return]
    raise ConfigError(f"the otel exporter must be one of {list(EXPORTERS)}, got {name!r}")


def setup_tracing(exporter: str, service_name: str) -> TracerProvider:
    """Install the global TracerProvider (once, from a service's main). Spans are always created, so
    trace context flows on to the next service even when this one exports nothing."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    chosen = make_exporter(exporter)
    if chosen is not None:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    trace.set_tracer_provider(provider)
    return provider


def grpc_trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata (`traceparent`, `tracestate`); empty when untraced."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def traced(name: str) -> Callable[[_F], _F]:
    """Decorator: run a function (sync or async) inside an INTERNAL span called `name`."""

    def wrap(fn: _F) -> _F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with tracer.start_as_current_span(name):
                    return await fn(*args, **kwargs)
            return cast(_F, run_async)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with tracer.start_as_current_span(name):
                return fn(*args, **kwargs)
        return cast(_F, run)

    return wrap


def _method_name(method: str | bytes) -> str:
    text = method.decode() if isinstance(method, bytes) else method
    return text.lstrip("/")


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


# ---- server side -----------------------------------------------------------------------------------


class TraceContextServerInterceptor(grpc.aio.ServerInterceptor):
    """Continues the caller's trace: each RPC runs in a SERVER span parented by its `traceparent`.

    Streaming handlers keep their style: an async-generator handler stays one (the span covers the
    whole stream), a handler that writes with `context.write` stays a coroutine.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = str(handler_call_details.method)  # type: ignore[attr-defined]
        if handler is None or method.startswith(_UNTRACED_PREFIX):
            return handler
        return _traced_handler(handler, _method_name(method))


@contextmanager
def _server_span(method: str, context: grpc.aio.ServicerContext) -> Iterator[Span]:
    parent: Context = propagate.extract(dict(context.invocation_metadata() or ()))
    with tracer.start_as_current_span(method, context=parent, kind=SpanKind.SERVER,
                                      attributes=_rpc_attributes(method)) as span:
        yield span


def _wrap_behavior(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with _server_span(method, context):
                async for item in behavior(request, context):
                    yield item
        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _server_span(method, context):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
    return call


def _traced_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
             ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler))
    for attribute, make in kinds:
        behavior = getattr(handler, attribute)
        if behavior is not None:
            return make(_wrap_behavior(behavior, method),  # type: ignore[operator]
                        request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


# ---- client side -----------------------------------------------------------------------------------


class _ClientTracing:
    """Starts a CLIENT span per call and puts its context into the call's metadata; the span ends
    when the call does (for streams: when the stream ends or is cancelled)."""

    def _start(self, details: grpc.aio.ClientCallDetails) -> tuple[Span, grpc.aio.ClientCallDetails]:
        method = _method_name(details.method)
        span = tracer.start_span(method, kind=SpanKind.CLIENT, attributes=_rpc_attributes(method))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = [(k, v) for k, v in (details.metadata or ()) if k not in carrier]
        metadata.extend(carrier.items())
        return span, grpc.aio.ClientCallDetails(details.method, details.timeout, grpc.aio.Metadata(*metadata),
                                                details.credentials, details.wait_for_ready)

    async def _call(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                    request: Any) -> Any:
        span, details = self._start(details)
        try:
            call = await continuation(details, request)
        except BaseException:
            span.end()
            raise
        call.add_done_callback(lambda _call: span.end())
        return call


class _UnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._call(continuation, client_call_details, request)


class _UnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._call(continuation, client_call_details, request)


class _StreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await self._call(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await self._call(continuation, client_call_details, request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For `grpc.aio.insecure_channel(address, interceptors=client_interceptors())`."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
