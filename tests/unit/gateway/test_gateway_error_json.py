"""Typed errors render as OpenAI error JSON with the status and retry headers clients act on."""

from __future__ import annotations

import json

from services.common.errors import BudgetExceededError, RateLimitError
from services.gateway.errors import ContextWindowError, OverloadedError, baton_error_response


def _render(exc: Exception) -> tuple[int, dict, dict[str, str]]:
    response = baton_error_response(exc)  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body)), dict(response.headers)


def test_a_scheduler_reject_is_503_with_retry_after() -> None:
    status, body, headers = _render(OverloadedError("no capacity now", retry_after_s=2.2))
    assert status == 503 and headers["retry-after"] == "3"
    assert body == {"error": {"message": "no capacity now", "type": "server_error", "param": None,
                              "code": "overloaded"}}


def test_a_rate_limit_is_429_with_the_bucket_type_and_headers() -> None:
    exc = RateLimitError("slow down", "key_tpm", 0.4, {"x-ratelimit-remaining-tokens": "0"})
    status, body, headers = _render(exc)
    assert status == 429 and headers["retry-after"] == "1" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert body["error"]["type"] == "tokens" and body["error"]["code"] == "rate_limit_exceeded"


def test_an_exhausted_budget_is_insufficient_quota() -> None:
    status, body, headers = _render(BudgetExceededError("budget reached"))
    assert status == 429 and body["error"]["type"] == "insufficient_quota" and "retry-after" not in headers


def test_a_context_overflow_names_the_parameter() -> None:
    status, body, _ = _render(ContextWindowError(2048, 2000, 100))
    assert status == 400
    assert body["error"]["param"] == "messages" and body["error"]["code"] == "context_length_exceeded"
    assert "2048" in body["error"]["message"] and "2100" in body["error"]["message"]
