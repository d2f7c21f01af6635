"""The gateway's own typed errors and their OpenAI error JSON at the HTTP edge.

Every error leaves as `{"error": {"message", "type", "param", "code"}}` with the status the typed
error carries; rate limits and overload add `Retry-After` (and the `x-ratelimit-*` headers). Nothing
below the routes builds an HTTP response: code raises these, `install_error_handlers` renders them.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.errors import (
    BatonError,
    BudgetExceededError,
    DependencyUnavailableError,
    InvalidRequestError,
    RateLimitError,
)

log = logging.getLogger(__name__)


class BadRequestError(InvalidRequestError):
    """Invalid input naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextWindowError(BadRequestError):
    """Prompt + max_tokens exceed the model's context window (checked before any GPU work)."""

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int, param: str = "messages") -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.", param, "context_length_exceeded")
        self.limit = limit
        self.prompt_tokens = prompt_tokens


class PromptTooLongError(BadRequestError):
    """Refused by its length in characters alone, before tokenizing (which costs ~1 s per MB)."""

    def __init__(self, limit: int, chars: int, min_tokens: int, param: str) -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, the prompt has {chars} "
            f"characters, which is at least {min_tokens} tokens. Please reduce the prompt.", param,
            "context_length_exceeded")


class ModelNotFoundError(BatonError):
    http_status = 404
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]) -> None:
        super().__init__(f"The model {model!r} does not exist; available: {available}")
        self.param = "model"


class OverloadedError(BatonError):
    """The scheduler rejected the request (or kept it queued too long): 503 with Retry-After."""

    http_status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(BatonError):
    """A worker, the scheduler or the safety service failed or is unreachable."""

    http_status = 502
    code = "upstream_error"


class FeatureDisabledError(BatonError):
    """A feature this gateway runs without (e.g. conversation storage in `BATON_AUTH_MODE=none`): 501,
    with `x-should-retry: false` so OpenAI SDKs don't retry it like other 5xx."""

    http_status = 501
    code = "feature_disabled"

    def __init__(self, feature: str, auth_mode: str) -> None:
        super().__init__(f"{feature} is disabled in auth_mode={auth_mode} (BATON_AUTH_MODE): this gateway runs "
                         "without a database")


class StreamGoneError(BatonError):
    """A Last-Event-ID resume asked for events no longer buffered."""

    http_status = 410
    code = "stream_replay_expired"


_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
          410: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, code: str | None, param: str | None = None,
               error_type: str | None = None) -> dict[str, object]:
    kind = error_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_headers(exc: BatonError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if isinstance(exc, RateLimitError):
        headers.update(exc.headers)
        if exc.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
    elif isinstance(exc, DependencyUnavailableError | OverloadedError) and exc.retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
    elif isinstance(exc, FeatureDisabledError):
        headers["x-should-retry"] = "false"
    return headers


def baton_error_response(exc: BatonError) -> JSONResponse:
    error_type = None
    if isinstance(exc, RateLimitError):
        error_type = "tokens" if exc.bucket.endswith("tpm") else "requests"
    elif isinstance(exc, BudgetExceededError):
        error_type = "insufficient_quota"
    body = error_body(exc.http_status, str(exc), exc.code, getattr(exc, "param", None), error_type)
    return JSONResponse(body, status_code=exc.http_status, headers=error_headers(exc))


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """The first problem of a failed validation, and the field it names (HTTP bodies and gRPC requests).

    A field that takes several forms (`prompt`: text, texts, token ids...) is named as the field, and
    the message says why each form failed, instead of naming pydantic's internal form tags."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    param, forms = _param_of(first.get("loc", ()))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if not forms:
        return f"{param or 'request'}: {first.get('msg', 'invalid')}{more}", param
    reasons = [f"as {'.'.join(form)}: {e.get('msg', 'invalid')}" for e in errors
               for p, form in [_param_of(e.get("loc", ()))] if p == param and form]
    return f"{param or 'request'}: no accepted form matches ({'; '.join(reasons[:6])})", param


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "set", "none"})


def _is_form_tag(part: object) -> bool:
    """pydantic's name for one member of a union (`str`, `list[int]`, `constrained-str`, `TextPart`)."""
    if not isinstance(part, str):
        return False
    return part in _TYPE_TAGS or part[:1].isupper() or not part.replace("_", "a").isalnum()


def _param_of(loc: tuple[int | str, ...] | list[int | str]) -> tuple[str | None, list[str]]:
    """(the field's dotted name, the union form tags and the rest after the first tag)."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    cut = next((i for i, p in enumerate(parts) if _is_form_tag(p)), len(parts))
    return ".".join(parts[:cut]) or None, parts[cut:]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BatonError)
    async def _baton(request: Request, exc: BatonError) -> JSONResponse:
        if exc.http_status >= 500:
            log.warning("%s %s failed: %s", request.method, request.url.path, exc)
        return baton_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return JSONResponse(error_body(400, message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, "internal server error", "internal_error"), status_code=500)
