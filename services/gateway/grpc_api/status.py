"""Typed errors -> gRPC statuses, with the same facts the HTTP API puts in its error JSON and headers.

The status code follows the HTTP status the error carries (the usual HTTP <-> gRPC correspondence:
401 UNAUTHENTICATED, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, ...). The trailing metadata carries
`baton-error-code` (e.g. `rate_limit_exceeded`), `baton-error-param` when a field is at fault, the
HTTP API's `retry-after` and `x-ratelimit-*` headers, and, when waiting helps, a google.rpc.Status
with a RetryInfo in `grpc-status-details-bin` (the standard place gRPC clients look for it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from services.common.errors import BatonError
from services.gateway.errors import error_headers

log = logging.getLogger(__name__)
DETAILS_KEY = "grpc-status-details-bin"
Metadata = tuple[tuple[str, str | bytes], ...]

_CODE_BY_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ABORTED,
    410: grpc.StatusCode.ABORTED, 413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED, 502: grpc.StatusCode.UNAVAILABLE, 503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


@dataclass(frozen=True)
class RpcFailure:
    """How a call ends: a status code, its message and the trailing metadata."""

    code: grpc.StatusCode
    message: str
    metadata: Metadata


def failure_of(exc: Exception) -> RpcFailure:
    if isinstance(exc, BatonError):
        return _baton_failure(exc)
    log.error("unexpected error in a gRPC API call", exc_info=exc)
    return _failure(grpc.StatusCode.INTERNAL, "internal server error", "internal_error")


def stream_failure(error: dict[str, object]) -> RpcFailure:
    """A choice failed after the stream began (the log's `{"error": ...}` event): the worker, the
    scheduler or the safety service let it down, so UNAVAILABLE; the text so far was already sent."""
    return _failure(grpc.StatusCode.UNAVAILABLE, str(error.get("message", "generation failed")),
                    str(error.get("code") or "upstream_error"))


def _baton_failure(exc: BatonError) -> RpcFailure:
    code = _CODE_BY_HTTP.get(exc.http_status,
                             grpc.StatusCode.INTERNAL if exc.http_status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)
    retry_after_s = getattr(exc, "retry_after_s", None)
    return _failure(code, str(exc), exc.code, getattr(exc, "param", None), error_headers(exc),
                    retry_after_s if isinstance(retry_after_s, int | float) else None)


def _failure(code: grpc.StatusCode, message: str, error_code: str, param: str | None = None,
             headers: dict[str, str] | None = None, retry_after_s: float | None = None) -> RpcFailure:
    metadata: list[tuple[str, str | bytes]] = [("baton-error-code", error_code)]
    if param:
        metadata.append(("baton-error-param", param))
    metadata += sorted((headers or {}).items())
    if retry_after_s is not None:
        metadata.append((DETAILS_KEY, _retry_details(code, message, retry_after_s)))
    return RpcFailure(code, message, tuple(metadata))


def _retry_details(code: grpc.StatusCode, message: str, retry_after_s: float) -> bytes:
    delay = Duration(seconds=max(1, math.ceil(retry_after_s)))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    return status.SerializeToString()
