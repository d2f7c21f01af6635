"""Versioned SQL migrations: `migrations/NNNN_description.sql`, applied in order, each exactly once.

Every start of a gateway (or the billing consumer) calls `apply_migrations`. It runs in ONE
transaction that first takes a transaction-scoped advisory lock, so when two processes start at once
the second waits for the first to commit and then finds nothing to do; a failing migration rolls
everything back, leaving the schema at its previous version. Each applied file's SHA-256 is recorded:
editing a migration after it shipped is refused (add a new one instead).

Synchronous on purpose: it runs once at start-up (async callers use `asyncio.to_thread`), and the
billing consumer, which is synchronous, shares it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from services.common.errors import MigrationError

# Any fixed 64-bit number works; it only has to be the same in every process that migrates.
_ADVISORY_LOCK_KEY = 0x6261746F6E  # "baton" in ASCII
_FILE_RE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    sha256     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations() -> list[Migration]:
    """The packaged migrations in version order; a gap or a duplicate version is an error."""
    found: list[Migration] = []
    for entry in resources.files("services.gateway.db").joinpath("migrations").iterdir():
        match = _FILE_RE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    expected = list(range(1, len(found) + 1))
    if [m.version for m in found] != expected:
        raise MigrationError(f"migration versions must be 1..N without gaps, got "
                             f"{[m.name for m in found]}")
    return found


def apply_migrations(conninfo: str, migrations: list[Migration] | None = None) -> list[str]:
    """Bring the database at `conninfo` to the newest schema. Returns the names applied now."""
    migrations = load_migrations() if migrations is None else migrations
    try:
        with psycopg.connect(conninfo) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK_KEY,))
            conn.execute(_CREATE_TABLE)
            applied = {row[0]: row[1] for row in conn.execute(
                "SELECT version, sha256 FROM schema_migrations")}
            _check_not_edited(migrations, applied)
            done: list[str] = []
            for migration in migrations:
                if migration.version in applied:
                    continue
                conn.execute(migration.sql.encode())  # bytes: no client-side %-placeholder parsing
                conn.execute("INSERT INTO schema_migrations (version, name, sha256) VALUES (%s, %s, %s)",
                             (migration.version, migration.name, migration.sha256))
                done.append(migration.name)
            return done
    except psycopg.Error as e:
        raise MigrationError(f"applying migrations failed: {e}") from e


def _check_not_edited(migrations: list[Migration], applied: dict[int, str]) -> None:
    for migration in migrations:
        recorded = applied.get(migration.version)
        if recorded is not None and recorded != migration.sha256:
            raise MigrationError(f"{migration.name} changed after it was applied "
                                 f"(recorded sha256 {recorded[:12]}..., now {migration.sha256[:12]}...); "
                                 f"add a new migration instead of editing a shipped one")
    newest_known = max((m.version for m in migrations), default=0)
    unknown = sorted(v for v in applied if v > newest_known)
    if unknown:
        raise MigrationError(f"database has migrations {unknown} newer than this code "
                             f"(newest {newest_known}): deploy the newer code")
