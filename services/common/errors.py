"""Typed errors of the platform services (gateway data layer, auth, rate limits, billing, launcher).

Raised inside the services and chained (`raise ... from e`); the HTTP edge maps them to OpenAI error
JSON (`http_status` + `code`), the CLI prints them. Nothing here imports a web framework.
"""

from __future__ import annotations

# The root and the two errors the engine raises too are defined once on the ground floor.
from tokenization.errors import BatonError, ConfigError, InvalidRequestError

__all__ = [
    "AuthenticationError", "BatonError", "BillingError", "BudgetExceededError", "ConfigError",
    "DependencyUnavailableError", "InfraStartError", "InvalidRequestError", "MigrationError", "NotFoundError",
    "RateLimitError", "RevokedKeyError", "UsageBacklogFullError",
]


class InfraStartError(BatonError):
    """An embedded service (Postgres, Redis, Kafka broker) failed to start; carries its log tail."""

    code = "infra_start_failed"


class MigrationError(BatonError):
    """The database schema could not be brought to the current version (or was edited after apply)."""

    code = "migration_failed"


class NotFoundError(BatonError, LookupError):
    """An organisation, user, key or conversation does not exist (or is soft-deleted)."""

    http_status = 404
    code = "not_found"


class AuthenticationError(BatonError):
    """The API key is missing, malformed, unknown or revoked. One class at the edge: don't leak which."""

    http_status = 401
    code = "invalid_api_key"


class RevokedKeyError(AuthenticationError):
    """The API key exists but was revoked (kept distinct for logs and metrics, same 401 outside)."""


class RateLimitError(BatonError):
    """A request or token bucket refused the request.

    `bucket` names the refusing bucket ("key_rpm", "key_tpm", "org_rpm", "org_tpm");
    `retry_after_s` is when the bucket will hold enough, or None when it never can (the request alone
    is larger than the bucket's capacity).
    """

    http_status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, bucket: str, retry_after_s: float | None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class DependencyUnavailableError(BatonError):
    """Postgres or Redis (or another backing service) cannot be reached: 503 with Retry-After, never a 500."""

    http_status = 503
    code = "service_unavailable"

    def __init__(self, message: str, retry_after_s: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BudgetExceededError(BatonError):
    """The organisation's spend this calendar month (UTC) has reached its monthly budget."""

    http_status = 429
    code = "insufficient_quota"


class BillingError(BatonError):
    """A usage event is invalid or cannot be billed."""

    code = "billing_error"


class UsageBacklogFullError(BillingError):
    """The usage producer holds too many undelivered events; the broker has been unreachable too long.

    Raised instead of silently dropping a billable event: the caller decides (fail the request closed).
    """

    http_status = 503
    code = "usage_backlog_full"
