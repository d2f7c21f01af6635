"""Per-test views of the session's real Postgres, Redis and Kafka broker (started in
tests/integration/conftest.py, shared with the gateway suite).

Each test starts from empty tables (one migrated database, truncated before every test), so tests never
see each other's rows; Redis keys and Kafka topics are made unique per test instead.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg import sql
from redis.asyncio import Redis

from services.gateway.db.pool import Database, DatabaseConfig
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.serve import migrate_database

# Kafka client settings for tests: fast group membership so a killed consumer's
# partitions move to its successor in about two seconds.
KAFKA_TEST_CONSUMER_CONFIG = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 300,
                              "max.poll.interval.ms": 10000}


@pytest.fixture(scope="session")
def migrated_database(postgres: EmbeddedPostgres) -> str:
    url = postgres.create_database("baton_test")
    migrate_database(url)
    return url


@pytest.fixture
def empty_database_url(postgres: EmbeddedPostgres) -> str:
    """A fresh database with no schema at all (migration tests)."""
    return postgres.create_database(f"t_{uuid.uuid4().hex[:16]}")


@pytest.fixture
def database_url(migrated_database: str) -> str:
    """The migrated test database, emptied: every table but schema_migrations truncated (a fresh
    database per test would cost a CREATE DATABASE, ~10x slower)."""
    with psycopg.connect(migrated_database, autocommit=True) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables "
            "WHERE schemaname = 'public' AND tablename <> 'schema_migrations'")]
        conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
            sql.SQL(", ").join(sql.Identifier(t) for t in tables)))
    return migrated_database


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database(DatabaseConfig(database_url, min_size=1, max_size=4))
    await database.open()
    yield database
    await database.close()


@pytest.fixture
async def redis_client(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    await client.aclose()
