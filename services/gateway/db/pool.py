"""`Database`: the gateway's async Postgres connection pool (psycopg 3), migrated before first use.

`async with db.connection() as conn:` is one transaction: committed when the block ends normally,
rolled back when it raises (psycopg_pool's contract). Stores take the `Database` and keep no
connection of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import psycopg
from psycopg_pool import AsyncConnectionPool

from services.common.errors import ConfigError
from services.common.settings import BatonSettings
from services.gateway.db.migrations import apply_migrations


@dataclass(frozen=True)
class DatabaseConfig:
    url: str
    min_size: int = 1
    max_size: int = 10
    migrate: bool = True
    open_timeout_s: float = 30.0

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
                                         open=False, name="baton-gateway")

    async def open(self) -> None:
        """Migrate (in a thread: it is synchronous and start-up only), then open the pool."""
        if self.config.migrate:
            await asyncio.to_thread(apply_migrations, self.config.url)
        await self._pool.open(wait=True, timeout=self.config.open_timeout_s)

    async def close(self) -> None:
        await self._pool.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection]:
        async with self._pool.connection() as conn:
            yield conn

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
