"""Schema migrations: applied once, safe to run concurrently, refusing edited or unknown history."""

from __future__ import annotations

import threading
from dataclasses import replace

import psycopg
import pytest

from services.common.errors import MigrationError
from services.gateway.db.migrations import Migration, apply_migrations, load_migrations


def _versions(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM schema_migrations ORDER BY version")]


def test_fresh_database_gets_every_migration_in_order(empty_database_url: str) -> None:
    names = apply_migrations(empty_database_url)
    assert names == [m.name for m in load_migrations()]
    assert _versions(empty_database_url) == list(range(1, len(names) + 1))


def test_second_run_applies_nothing(empty_database_url: str) -> None:
    apply_migrations(empty_database_url)
    assert apply_migrations(empty_database_url) == []


def test_concurrent_starts_apply_each_migration_exactly_once(empty_database_url: str) -> None:
    results: list[list[str]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def start_gateway() -> None:
        barrier.wait()
        try:
            results.append(apply_migrations(empty_database_url))
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=start_gateway) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(len(r) for r in results) == [0, 0, 0, len(load_migrations())]
    assert _versions(empty_database_url) == [m.version for m in load_migrations()]


def test_edited_migration_is_refused(empty_database_url: str) -> None:
    apply_migrations(empty_database_url)
    edited = [replace(m, sql=m.sql + "\n-- edited") if m.version == 1 else m for m in load_migrations()]
    with pytest.raises(MigrationError, match="changed after it was applied"):
        apply_migrations(empty_database_url, edited)


def test_failing_migration_rolls_back_the_whole_run(empty_database_url: str) -> None:
    broken = [*load_migrations()]
    broken.append(Migration(len(broken) + 1, "9999_broken.sql",
                            "CREATE TABLE half_done (id int); SELECT no_such_column FROM half_done;"))
    with pytest.raises(MigrationError):
        apply_migrations(empty_database_url, broken)
    with psycopg.connect(empty_database_url) as conn:
        tables = {r[0] for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert tables == set()  # not even schema_migrations: one transaction, all rolled back


def test_database_newer_than_code_is_refused(empty_database_url: str) -> None:
    apply_migrations(empty_database_url)
    with pytest.raises(MigrationError, match="newer than this code"):
        apply_migrations(empty_database_url, load_migrations()[:-1])
