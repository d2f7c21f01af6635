"""The cluster token: what every internal gRPC port (scheduler, workers, safety) asks of its callers.

A Baton cluster shares one secret, `BATON_CLUSTER_TOKEN` (`baton serve` generates one and hands it to
its children; the Helm chart keeps it in a Secret). Every internal server refuses a call without it
with UNAUTHENTICATED, before any handler runs: a rogue `baton worker` cannot register with the
scheduler, and nobody reaches a worker's `Generate` around the gateway's keys, safety and billing.
Clients put it into each call's metadata (`x-baton-cluster-token`): channel interceptors, or per call
where the path is per request (the gateway's worker calls, beside the trace context).

gRPC health checks stay open (Kubernetes probes carry no metadata); they say SERVING or not and nothing
else. The comparison is constant-time over SHA-256 digests, so neither the token's bytes nor its length
leak through timing. A rotation admits a second token for a while (`BATON_CLUSTER_TOKEN_ROTATING`).
Without a token (a component started by hand, library use in tests) a server takes anyone and says
so in a warning at start.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.errors import ConfigError
from services.common.tracing import TraceContextServerInterceptor, client_interceptors

log = logging.getLogger(__name__)

TOKEN_ENV = "BATON_CLUSTER_TOKEN"
ROTATING_ENV = "BATON_CLUSTER_TOKEN_ROTATING"
METADATA_KEY = "x-baton-cluster-token"
MIN_TOKEN_CHARS = 16
# Probes (Kubernetes sends no metadata): SERVING or NOT_SERVING is all they say. Health's `List`, which
# names every service, is not among them.
_OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
_REFUSAL = "this port is internal to the Baton cluster: missing or wrong cluster token (BATON_CLUSTER_TOKEN)"


def _check(name: str, value: str) -> None:
    if len(value) < MIN_TOKEN_CHARS or not value.isprintable() or value.strip() != value:
        raise ConfigError(f"{name} must be at least {MIN_TOKEN_CHARS} printable characters without "
                          "surrounding spaces, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")


@dataclass(frozen=True)
class ClusterToken:
    """The shared secret; `repr` never shows it (configs holding it get logged).

    `rotating`: during a rotation, the other token (the next one, then the previous one), admitted by
    servers but never sent; see docs/operations.md for the three rolling restarts."""

    value: str = field(repr=False)
    rotating: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check(TOKEN_ENV, self.value)
        if self.rotating is not None:
            _check(ROTATING_ENV, self.rotating)

    @classmethod
    def generate(cls) -> ClusterToken:
        return cls(secrets.token_urlsafe(32))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ClusterToken | None:
        """`BATON_CLUSTER_TOKEN` and `BATON_CLUSTER_TOKEN_ROTATING` (for mains only); None when unset."""
        value = environ.get(TOKEN_ENV, "")
        if not value:
            if environ.get(ROTATING_ENV):
                raise ConfigError(f"{ROTATING_ENV} needs {TOKEN_ENV}")
            return None
        return cls(value, environ.get(ROTATING_ENV) or None)

    @property
    def metadata(self) -> tuple[str, str]:
        return METADATA_KEY, self.value

    def admits(self, presented: str | bytes | None) -> bool:
        if presented is None:
            return False
        raw = presented.encode() if isinstance(presented, str) else presented
        digest = hashlib.sha256(raw).digest()
        # Both compared, always: the time taken says nothing about which one matched.
        matches = [hmac.compare_digest(digest, accepted) for accepted in self._digests]
        return any(matches)

    @functools.cached_property
    def _digests(self) -> tuple[bytes, ...]:
        return tuple(hashlib.sha256(v.encode()).digest() for v in (self.value, self.rotating) if v is not None)


# ---- server side -----------------------------------------------------------------------------------


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


# One refusal per RPC kind: the caller's stub expects its own kind's framing. No deserializer: the
# request's bytes are never parsed.
_REFUSALS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler(_refuse),
    "unary_stream": grpc.unary_stream_rpc_method_handler(_refuse),
    "stream_unary": grpc.stream_unary_rpc_method_handler(_refuse),
    "stream_stream": grpc.stream_stream_rpc_method_handler(_refuse),
}


def _refusal_for(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    # An unknown method is refused like a known one: an outsider learns nothing about what exists.
    if handler is not None:
        for kind, refusal in _REFUSALS.items():
            if getattr(handler, kind) is not None:
                return refusal
    return _REFUSALS["unary_unary"]


class ClusterTokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with the cluster token in its metadata (health checks always)."""

    def __init__(self, token: ClusterToken) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)  # type: ignore[attr-defined]
        if method in _OPEN_METHODS or self._admits(handler_call_details):
            return await continuation(handler_call_details)
        return _refusal_for(await continuation(handler_call_details))

    def _admits(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == METADATA_KEY:
                return self._token.admits(value)
        return False


def internal_server(token: ClusterToken | None, name: str,
                    options: Sequence[tuple[str, Any]] | None = None) -> grpc.aio.Server:
    """A grpc.aio server for an internal port: the token check first, then trace context."""
    interceptors: list[grpc.aio.ServerInterceptor] = [TraceContextServerInterceptor()]
    if token is None:
        log.warning("%s: no %s: this gRPC port takes calls from ANYONE who can reach it (set the token, as "
                    "`baton serve` and the Helm chart do)", name, TOKEN_ENV)
    else:
        interceptors.insert(0, ClusterTokenServerInterceptor(token))
    # A taken port is an error, not a second server sharing it: gRPC's default SO_REUSEPORT would let a
    # worker bind a port another worker holds, and callers would reach either one.
    return grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0), *(options or ())])


def bind_internal_port(server: grpc.aio.Server, address: str) -> int:
    """Bind `address` (port 0: any free one) and return the port; a port another process holds is an
    OSError that says so (gRPC's own error names neither the cause nor the port's owner)."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: address already in use, or not an address of this host "
                      f"({e})") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


# ---- client side -----------------------------------------------------------------------------------


def _with_token(details: grpc.aio.ClientCallDetails, pair: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY], pair)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AttachToken:
    def __init__(self, token: ClusterToken) -> None:
        self._pair = token.metadata


class _UnaryUnary(_AttachToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._pair), request)


class _UnaryStream(_AttachToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._pair), request)


class _StreamUnary(_AttachToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._pair), request_iterator)


class _StreamStream(_AttachToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._pair), request_iterator)


def token_interceptors(token: ClusterToken | None) -> list[grpc.aio.ClientInterceptor]:
    """Attach the token to every call of a grpc.aio channel (nothing without a token)."""
    if token is None:
        return []
    return [_UnaryUnary(token), _UnaryStream(token), _StreamUnary(token), _StreamStream(token)]


def internal_channel(address: str, token: ClusterToken | None,
                     options: Sequence[tuple[str, Any]] | None = None, traced: bool = True) -> grpc.aio.Channel:
    """A grpc.aio channel to an internal port: every call carries the token (and the trace context)."""
    interceptors = [*token_interceptors(token), *(client_interceptors() if traced else [])]
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)


class _SyncDetails(collections.namedtuple("_SyncDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _SyncAttachToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                       grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: ClusterToken) -> None:
        self._pair = token.metadata

    def _details(self, d: grpc.ClientCallDetails) -> _SyncDetails:
        metadata = [(k, v) for k, v in (d.metadata or ()) if k != METADATA_KEY]  # type: ignore[attr-defined]
        return _SyncDetails(d.method, d.timeout, [*metadata, self._pair], d.credentials,  # type: ignore[attr-defined]
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def sync_internal_channel(address: str, token: ClusterToken | None) -> grpc.Channel:
    """A blocking channel (CLIs, benchmarks) whose every call carries the token."""
    channel = grpc.insecure_channel(address)
    return channel if token is None else grpc.intercept_channel(channel, _SyncAttachToken(token))
