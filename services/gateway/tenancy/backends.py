"""`TenantServices`: the gateway's per-tenant backends, and the two ways to build them (`BATON_AUTH_MODE`).

Everything the gateway knows about tenants goes through this one object: who is calling (API keys),
what they may use (RPM/TPM rate limits, monthly budgets), what they used (the usage outbox and
the `/v1/usage` report) and what they keep (conversations). Routes and services see it only through
the small protocols below, so the two modes differ here and nowhere else:

- `api_key` (default, `build_platform_tenancy`): API keys and budgets in Postgres, rate limits in
  Redis, usage events into the Postgres outbox (a local spool while Postgres is down), whose relay
  publishes them to Kafka (services/billing/outbox.py, relay.py). Every client library (psycopg,
  redis, confluent-kafka) is imported inside that factory, so a gateway in `none` mode runs without
  any of them installed.
- `none` (`build_open_tenancy`), for benchmarks and single-user development: no API key is checked
  (every request, with or without `Authorization`, is one anonymous organisation at a configured tier,
  whose SLO comes from `BATON_SLOS`), no rate limits, no budget, usage events are dropped, and
  conversation storage and `/v1/usage` answer 501 `feature_disabled`. Never expose it to a network:
  anyone who reaches the port can use the cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import date
from typing import TYPE_CHECKING, Any, Literal, Protocol

from prometheus_client.registry import Collector

from scheduler.types import Tier
from services.common.settings import BatonSettings
from services.gateway.errors import FeatureDisabledError
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.ratelimit import RateLimitLease

if TYPE_CHECKING:
    from services.billing.events import UsageEvent
    from services.gateway.db.conversations import ConversationStore

AuthMode = Literal["api_key", "none"]
AUTH_MODES: tuple[AuthMode, ...] = ("api_key", "none")
Probe = Callable[[], Awaitable[object]]
# The anonymous caller of `none` mode: fixed ids, so logs and stream scoping stay consistent.
ANONYMOUS_ORG_ID = uuid.UUID("00000000-0000-0000-0000-00000000a10e")
ANONYMOUS_KEY_ID = uuid.UUID("00000000-0000-0000-0000-00000000a10f")


class Authenticator(Protocol):
    async def authenticate_bearer(self, token: str | None) -> Principal:
        """The caller of a request whose `Authorization: Bearer` token is `token` (None: no header)."""
        ...


class Admission(Protocol):
    """RPM/TPM buckets: `acquire` before a request runs (raises RateLimitError), `reconcile` after."""

    async def acquire(self, principal: Principal, estimated_tokens: int) -> RateLimitLease: ...

    async def reconcile(self, lease: RateLimitLease, actual_tokens: int) -> None: ...


class UsageSink(Protocol):
    """Where usage events go (the `UsageOutbox`): `record` returns once the event is durable, and
    never raises."""

    async def record(self, event: UsageEvent) -> None: ...

    @property
    def pending(self) -> int: ...


class BudgetCheck(Protocol):
    async def check(self, org_id: uuid.UUID) -> object:
        """Raise BudgetExceededError once the organisation's monthly budget is spent."""
        ...


class UsageReports(Protocol):
    async def report(self, org_id: uuid.UUID, start: str | None, end: str | None, group_by: str | None,
                     today: date) -> dict[str, object]:
        """The `/v1/usage` body for one organisation (bad parameters raise InvalidRequestError)."""
        ...


@dataclass
class TenantServices:
    mode: AuthMode
    authenticator: Authenticator
    admission: Admission
    budget: BudgetCheck
    usage: UsageSink
    conversations: ConversationStore | None  # None: conversation storage is disabled (501)
    usage_reports: UsageReports | None  # None: `/v1/usage` is disabled (501)
    readiness: dict[str, Probe] = field(default_factory=dict)  # name -> probe, for /readyz
    on_start: Callable[[], Awaitable[None]] | None = None
    on_close: Callable[[], Awaitable[None]] | None = None
    metrics: Collector | None = None  # extra gateway metrics (the billing outbox's backlog and lag)

    def conversation_store(self) -> ConversationStore:
        if self.conversations is None:
            raise FeatureDisabledError("conversation storage", self.mode)
        return self.conversations

    def usage_report_source(self) -> UsageReports:
        if self.usage_reports is None:
            raise FeatureDisabledError("usage reporting", self.mode)
        return self.usage_reports

    async def start(self) -> None:
        if self.on_start is not None:
            await self.on_start()

    async def close(self) -> None:
        if self.on_close is not None:
            await self.on_close()


# ---- auth_mode=none -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AnonymousAuthenticator:
    """Every request is the same anonymous principal; a presented key is ignored, not checked."""

    tier: Tier

    async def authenticate_bearer(self, token: str | None) -> Principal:
        return Principal(ANONYMOUS_KEY_ID, ANONYMOUS_ORG_ID, None, self.tier, None, None)


class Unlimited:
    """Admits everything; the lease carries no rate-limit status (no `x-ratelimit-*` headers)."""

    async def acquire(self, principal: Principal, estimated_tokens: int) -> RateLimitLease:
        return RateLimitLease(principal.org_id, principal.key_id, None, estimated_tokens, None)

    async def reconcile(self, lease: RateLimitLease, actual_tokens: int) -> None:
        return None


class NoBudget:
    async def check(self, org_id: uuid.UUID) -> None:
        return None


class DroppedUsage:
    """Usage events go nowhere (nothing is billed); `dropped` counts them."""

    def __init__(self) -> None:
        self.dropped = 0

    async def record(self, event: UsageEvent) -> None:
        self.dropped += 1

    @property
    def pending(self) -> int:
        return 0


def build_open_tenancy(tier: Tier) -> TenantServices:
    return TenantServices("none", AnonymousAuthenticator(tier), Unlimited(), NoBudget(), DroppedUsage(),
                          conversations=None, usage_reports=None)


# ---- auth_mode=api_key --------------------------------------------------------------------------


class DatabaseUsageReports:
    """`/v1/usage` from the billing aggregates in Postgres."""

    def __init__(self, db: Any) -> None:  # services.gateway.db.pool.Database
        self._db = db

    async def report(self, org_id: uuid.UUID, start: str | None, end: str | None, group_by: str | None,
                     today: date) -> dict[str, object]:
        from services.billing.usage import UsageQuery, query_usage

        query = UsageQuery.parse(org_id, start, end, group_by, today)
        async with self._db.connection() as conn:
            return (await query_usage(conn, query)).to_dict()


def build_platform_tenancy(settings: BatonSettings) -> TenantServices:
    """API keys, budgets, conversations and the usage outbox in Postgres, rate limits in Redis.

    Call inside the running event loop (the Redis and database clients belong to it)."""
    from redis.asyncio import Redis

    from services.billing.outbox import UsageOutbox
    from services.billing.producer import ProducerConfig, UsageProducer
    from services.billing.relay import OutboxRelay, RelayConfig
    from services.billing.schema import migrate_billing
    from services.billing.spool import UsageSpool
    from services.common.errors import ConfigError
    from services.gateway.db.api_keys import ApiKeyStore
    from services.gateway.db.conversations import ConversationStore
    from services.gateway.db.pool import Database, DatabaseConfig
    from services.gateway.tenancy.auth import ApiKeyAuthenticator
    from services.gateway.tenancy.budget import BudgetGuard
    from services.gateway.tenancy.ratelimit import RateLimitConfig, RateLimiter

    if not settings.redis_url:
        raise ConfigError("no Redis: set BATON_REDIS_URL (or run `baton serve`), "
                          "or BATON_AUTH_MODE=none for a single-user gateway without tenants")
    db = Database(DatabaseConfig.from_settings(settings))
    # Short timeouts: with Redis down a request is admitted or refused (ratelimit.py) within ~1 s.
    redis = Redis.from_url(settings.redis_url, socket_connect_timeout=1, socket_timeout=2)
    producer = UsageProducer(ProducerConfig.from_settings(settings))
    spool = UsageSpool(settings.usage_spool_dir)
    relay = OutboxRelay(db, producer, spool, RelayConfig.from_settings(settings, db.config.url))
    usage = UsageOutbox(db, spool, relay)

    async def start() -> None:
        import asyncio

        await db.open()
        if db.config.migrate:  # the ledger /v1/usage reads (and the usage outbox) are billing's tables
            await asyncio.to_thread(migrate_billing, db.config.url)
        producer.start()
        relay.start()

    async def close() -> None:
        import asyncio

        await relay.close()  # publishes what is left (bounded); the rest waits in Postgres or the spool
        await asyncio.to_thread(producer.close, 1.0)
        await redis.aclose()
        await db.close()

    return TenantServices(
        "api_key", ApiKeyAuthenticator(ApiKeyStore(db)), RateLimiter(redis, RateLimitConfig.from_settings(settings)),
        BudgetGuard(db), usage, ConversationStore(db), DatabaseUsageReports(db),
        readiness={"database": db.ping, "redis": redis.ping}, on_start=start, on_close=close, metrics=usage)
