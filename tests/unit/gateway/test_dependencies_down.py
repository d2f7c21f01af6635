"""Redis or Postgres unreachable: rate limiting fails open or closed as configured, the database is a
503 with Retry-After, never a 500; each outage is logged once and its end once."""

from __future__ import annotations

import logging
import uuid

import pytest
from redis.asyncio import Redis

from services.common.errors import DependencyUnavailableError
from services.common.settings import TierLimitSettings
from services.gateway.db.pool import Database, DatabaseConfig
from services.gateway.errors import baton_error_response
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.outage import OutageLog
from services.gateway.tenancy.ratelimit import RateLimitConfig, RateLimiter
from services.launcher.process import free_port

PRINCIPAL = Principal(uuid.uuid4(), uuid.uuid4(), None, "free", None, None)
LIMITS = {t: TierLimitSettings(key_rpm=10, key_tpm=10_000, org_rpm=10, org_tpm=10_000)
          for t in ("free", "plus", "enterprise")}


def _limiter(mode: str) -> RateLimiter:
    redis = Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    return RateLimiter(redis, RateLimitConfig(LIMITS, on_redis_error=mode))  # type: ignore[arg-type]


async def test_redis_down_fails_open_without_limits() -> None:
    lease = await _limiter("open").acquire(PRINCIPAL, 100)
    assert lease.limits is None and lease.headers() == {}


async def test_redis_down_fails_closed_with_503_and_retry_after() -> None:
    with pytest.raises(DependencyUnavailableError) as e:
        await _limiter("closed").acquire(PRINCIPAL, 100)
    response = baton_error_response(e.value)
    assert response.status_code == 503 and response.headers["retry-after"] == "5"


async def test_postgres_down_is_a_503_not_a_hang() -> None:
    db = Database(DatabaseConfig(f"postgresql://postgres@127.0.0.1:{free_port()}/x", min_size=0,
                                 migrate=False, acquire_timeout_s=0.5))
    await db._pool.open(wait=False)
    try:
        with pytest.raises(DependencyUnavailableError, match="database is unavailable"):
            async with db.connection():
                pass
        assert db.outage.down_since is not None
    finally:
        await db.close()


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    outage = OutageLog("redis")
    with caplog.at_level(logging.WARNING, logger="services.gateway.tenancy.outage"):
        for _ in range(50):
            outage.failed(ConnectionError("refused"))
        outage.succeeded()
        outage.succeeded()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["redis unreachable", "redis is back after 0.0s"]
