"""Schema migrations: one folder per owner, applied once, safe to run concurrently, refusing edited or
unknown history, and upgrading a database migrated before billing owned its tables."""

from __future__ import annotations

import threading
from dataclasses import replace

import psycopg
import pytest

from services.billing.schema import BILLING_SCHEMA, migrate_billing
from services.common.errors import MigrationError
from services.common.migrations import MOVED, Migration, apply_migrations
from services.gateway.db.migrations import GATEWAY_SCHEMA, migrate_gateway

GATEWAY_TABLES = {"organisations", "users", "api_keys", "conversations", "messages"}
BILLING_TABLES = {"usage_events", "usage_daily", "usage_outbox", "billing_consumer_progress"}


def _recorded(url: str) -> list[tuple[str, int, str]]:
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT owner, version, name FROM schema_migrations ORDER BY owner, version")]


def _tables(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}


def test_each_owner_applies_only_its_own_folder_in_order(empty_database_url: str) -> None:
    assert migrate_gateway(empty_database_url) == [m.name for m in GATEWAY_SCHEMA.load()]
    assert _tables(empty_database_url) == GATEWAY_TABLES | {"schema_migrations"}
    assert migrate_billing(empty_database_url) == [m.name for m in BILLING_SCHEMA.load()]
    assert _tables(empty_database_url) == GATEWAY_TABLES | BILLING_TABLES | {"schema_migrations"}
    assert _recorded(empty_database_url) == (
        [("billing", m.version, m.name) for m in BILLING_SCHEMA.load()]
        + [("gateway", m.version, m.name) for m in GATEWAY_SCHEMA.load()])


def test_billing_migrates_without_the_gateway(empty_database_url: str) -> None:
    migrate_billing(empty_database_url)
    assert _tables(empty_database_url) == BILLING_TABLES | {"schema_migrations"}


def test_second_run_applies_nothing(empty_database_url: str) -> None:
    migrate_gateway(empty_database_url)
    migrate_billing(empty_database_url)
    assert migrate_gateway(empty_database_url) == [] and migrate_billing(empty_database_url) == []


def test_concurrent_starts_apply_each_migration_exactly_once(empty_database_url: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def start(migrate) -> None:  # noqa: ANN001 - migrate_gateway or migrate_billing
        barrier.wait()
        try:
            results.append(migrate(empty_database_url))
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(m,)) for m in (migrate_gateway, migrate_billing) * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(len(r) for r in results) == sorted([0, 0, len(GATEWAY_SCHEMA.load()), len(BILLING_SCHEMA.load())])
    assert len(_recorded(empty_database_url)) == len(GATEWAY_SCHEMA.load()) + len(BILLING_SCHEMA.load())


def test_a_database_from_before_owners_keeps_its_history(empty_database_url: str) -> None:
    """Old bookkeeping (no owner column, billing's files as the gateway's 0003/0004): nothing re-runs,
    billing's rows are re-homed under billing with their checksums, and both owners go on as usual."""
    moved = {m.name: m for m in MOVED}
    old = [(m.version, m.name, m.sql) for m in GATEWAY_SCHEMA.load()]
    old += [(int(moved[m.name].old_name[:4]), moved[m.name].old_name, m.sql) for m in BILLING_SCHEMA.load()
            if m.name in moved]  # billing's later migrations never existed under the gateway
    with psycopg.connect(empty_database_url) as conn, conn.transaction():
        conn.execute("CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL, "
                     "sha256 text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
        for version, name, sql in old:
            conn.execute(sql.encode())
            conn.execute("INSERT INTO schema_migrations (version, name, sha256) VALUES (%s, %s, %s)",
                         (version, name, Migration(version, name, sql).sha256))
    assert migrate_gateway(empty_database_url) == []
    assert migrate_billing(empty_database_url) == [m.name for m in BILLING_SCHEMA.load() if m.name not in moved]
    assert _recorded(empty_database_url) == (
        [("billing", m.version, m.name) for m in BILLING_SCHEMA.load()]
        + [("gateway", m.version, m.name) for m in GATEWAY_SCHEMA.load()])


def test_edited_migration_is_refused(empty_database_url: str) -> None:
    migrate_gateway(empty_database_url)
    edited = [replace(m, sql=m.sql + "\n-- edited") if m.version == 1 else m for m in GATEWAY_SCHEMA.load()]
    with pytest.raises(MigrationError, match="changed after it was applied"):
        apply_migrations(empty_database_url, GATEWAY_SCHEMA, edited)


def test_failing_migration_rolls_back_the_whole_run(empty_database_url: str) -> None:
    broken = [*BILLING_SCHEMA.load()]
    broken.append(Migration(len(broken) + 1, "9999_broken.sql",
                            "CREATE TABLE half_done (id int); SELECT no_such_column FROM half_done;"))
    with pytest.raises(MigrationError):
        apply_migrations(empty_database_url, BILLING_SCHEMA, broken)
    assert _tables(empty_database_url) == set()  # not even schema_migrations: one transaction, all rolled back


def test_database_newer_than_code_is_refused(empty_database_url: str) -> None:
    migrate_billing(empty_database_url)
    with pytest.raises(MigrationError, match="newer than this code"):
        apply_migrations(empty_database_url, BILLING_SCHEMA, BILLING_SCHEMA.load()[:-1])
