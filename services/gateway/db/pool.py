"""`Database`: the gateway's async Postgres connection pool (psycopg 3), migrated before first use.

`async with db.connection() as conn:` is one transaction: committed when the block ends normally,
rolled back when it raises (psycopg_pool's contract). Stores take the `Database` and keep no
connection of their own.

Postgres unreachable: a connection that cannot be had within `acquire_timeout_s`, or that fails as
a connection (`psycopg.OperationalError`), raises `DependencyUnavailableError` (503 + Retry-After)
instead of a 500, and the outage is logged once, its end once (outage.py). Pooled connections are
checked when taken, so after a Postgres restart no request is handed a dead one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from services.common.errors import ConfigError, DependencyUnavailableError
from services.common.settings import BatonSettings
from services.gateway.db.migrations import migrate_gateway
from services.gateway.tenancy.outage import OutageLog


@dataclass(frozen=True)
class DatabaseConfig:
    url: str
    min_size: int = 1
    max_size: int = 10
    migrate: bool = True
    open_timeout_s: float = 30.0
    acquire_timeout_s: float = 5.0  # a request waits at most this long for a connection (then 503)

    @classmethod
    def from_settings(cls, settings: BatonSettings, url: str | None = None) -> DatabaseConfig:
        """`url` overrides the setting (an embedded Postgres started by the launcher)."""
        resolved = url or settings.database_url
        if not resolved:
            raise ConfigError("no database: set BATON_DATABASE_URL (or let `baton serve` embed one)")
        return cls(resolved, settings.db_pool_min_size, settings.db_pool_max_size)


class Database:
    def __init__(self, config: DatabaseConfig) -> None:
        self.config = config
        self._pool = AsyncConnectionPool(config.url, min_size=config.min_size, max_size=config.max_size,
                                         open=False, name="baton-gateway", timeout=config.acquire_timeout_s,
                                         check=AsyncConnectionPool.check_connection,
                                         kwargs={"connect_timeout": max(1, int(config.acquire_timeout_s))})
        self.outage = OutageLog("postgres")

    async def open(self) -> None:
        """Migrate the gateway's tables (in a thread: it is synchronous and start-up only), then open the pool."""
        if self.config.migrate:
            await asyncio.to_thread(migrate_gateway, self.config.url)
        await self._pool.open(wait=True, timeout=self.config.open_timeout_s)

    async def close(self) -> None:
        await self._pool.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection]:
        try:
            async with self._pool.connection() as conn:
                yield conn
        except (PoolTimeout, psycopg.OperationalError) as e:
            self.outage.failed(e)
            raise DependencyUnavailableError("the database is unavailable; retry later") from e
        self.outage.succeeded()

    async def ping(self) -> bool:
        """For `/readyz`: a round trip through the pool."""
        async with self.connection() as conn:
            await conn.execute("SELECT 1")
        return True

    async def __aenter__(self) -> Database:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def returned(row: tuple | None) -> tuple:
    """The row of an `INSERT/UPDATE ... RETURNING` that must have matched (an invariant, not input)."""
    assert row is not None, "RETURNING gave no row"
    return row
