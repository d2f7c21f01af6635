"""Versioned SQL migrations, one folder per owner: `<package>/migrations/NNNN_description.sql`.

Each component owns the tables it writes and their migrations (`SchemaOwner`): the gateway its accounts
and conversations (services/gateway/db/migrations), billing its ledger and outbox
(services/billing/migrations). Versions count 1..N per owner, and `schema_migrations` records
(owner, version) once applied, with the file's SHA-256: editing a migration after it shipped is refused
(add a new one instead).

`apply_migrations` runs in ONE transaction that first takes a transaction-scoped advisory lock, so when
two processes start at once the second waits for the first to commit and then finds nothing to do; a
failing migration rolls everything back, leaving the schema at its previous version.

Databases from before the per-owner folders: `schema_migrations` had no owner column and billing's
files were the gateway's 0003 and 0004. The first run of this code (any owner) adds the column (old
rows are the gateway's) and re-homes those rows under their new owner and name (`MOVED`); the SQL is
unchanged, so the recorded checksums still match and nothing runs twice. Older code then refuses that
database ("newer than this code"), as it would after any new migration.

Synchronous on purpose: it runs once at start-up (async callers use `asyncio.to_thread`), and the
billing consumer, which is synchronous, shares it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources

import psycopg

from services.common.errors import MigrationError


class SchemaOwner(StrEnum):
    GATEWAY = "gateway"
    BILLING = "billing"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


@dataclass(frozen=True)
class MigrationSet:
    """One owner's migrations: the `migrations/` folder inside `package`."""

    owner: SchemaOwner
    package: str

    def load(self) -> list[Migration]:
        """The packaged migrations in version order; a gap or a duplicate version is an error."""
        found: list[Migration] = []
        for entry in resources.files(self.package).joinpath("migrations").iterdir():
            match = _FILE_RE.match(entry.name)
            if match:
                found.append(Migration(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
        found.sort(key=lambda m: m.version)
        if [m.version for m in found] != list(range(1, len(found) + 1)):
            raise MigrationError(f"{self.owner} migration versions must be 1..N without gaps, got "
                                 f"{[m.name for m in found]}")
        return found


@dataclass(frozen=True)
class MovedMigration:
    """A migration that changed owner: applied as `old_name` of `old_owner`, now `name` (`version`) of `owner`."""

    old_owner: SchemaOwner
    old_name: str
    owner: SchemaOwner
    version: int
    name: str


MOVED = (
    MovedMigration(SchemaOwner.GATEWAY, "0003_usage.sql", SchemaOwner.BILLING, 1, "0001_usage.sql"),
    MovedMigration(SchemaOwner.GATEWAY, "0004_usage_outbox.sql", SchemaOwner.BILLING, 2, "0002_usage_outbox.sql"),
)

# Any fixed 64-bit number works; it only has to be the same in every process that migrates.
_ADVISORY_LOCK_KEY = 0x6261746F6E  # "baton" in ASCII
_FILE_RE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    owner      text NOT NULL,
    version    integer NOT NULL,
    name       text NOT NULL,
    sha256     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (owner, version)
)"""
# The table as it was before owners: every row the gateway's, keyed by version alone.
_ADD_OWNER = """
ALTER TABLE schema_migrations ADD COLUMN owner text NOT NULL DEFAULT 'gateway';
ALTER TABLE schema_migrations ALTER COLUMN owner DROP DEFAULT;
ALTER TABLE schema_migrations DROP CONSTRAINT schema_migrations_pkey;
ALTER TABLE schema_migrations ADD PRIMARY KEY (owner, version)"""
_HAS_OWNER = """
SELECT 1 FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name = 'schema_migrations' AND column_name = 'owner'"""
_REHOME = "UPDATE schema_migrations SET owner = %s, version = %s, name = %s WHERE owner = %s AND name = %s"


def apply_migrations(conninfo: str, schema: MigrationSet, migrations: list[Migration] | None = None) -> list[str]:
    """Bring `schema`'s tables in the database at `conninfo` to their newest version; returns the names
    applied now. `migrations` replaces the packaged ones (tests)."""
    migrations = schema.load() if migrations is None else migrations
    try:
        with psycopg.connect(conninfo) as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK_KEY,))
            conn.execute(_CREATE_TABLE)
            _upgrade_bookkeeping(conn)
            applied = {row[0]: row[1] for row in conn.execute(
                "SELECT version, sha256 FROM schema_migrations WHERE owner = %s", (schema.owner.value,))}
            _check_not_edited(schema.owner, migrations, applied)
            done: list[str] = []
            for migration in migrations:
                if migration.version in applied:
                    continue
                conn.execute(migration.sql.encode())  # bytes: no client-side %-placeholder parsing
                conn.execute("INSERT INTO schema_migrations (owner, version, name, sha256) VALUES (%s, %s, %s, %s)",
                             (schema.owner.value, migration.version, migration.name, migration.sha256))
                done.append(migration.name)
            return done
    except psycopg.Error as e:
        raise MigrationError(f"applying {schema.owner} migrations failed: {e}") from e


def _upgrade_bookkeeping(conn: psycopg.Connection) -> None:
    """Bring a `schema_migrations` from before owners and moves up to date (a no-op once done)."""
    if conn.execute(_HAS_OWNER).fetchone() is None:
        conn.execute(_ADD_OWNER.encode())
    for m in MOVED:
        conn.execute(_REHOME, (m.owner.value, m.version, m.name, m.old_owner.value, m.old_name))


def _check_not_edited(owner: SchemaOwner, migrations: list[Migration], applied: dict[int, str]) -> None:
    for migration in migrations:
        recorded = applied.get(migration.version)
        if recorded is not None and recorded != migration.sha256:
            raise MigrationError(f"{owner} {migration.name} changed after it was applied "
                                 f"(recorded sha256 {recorded[:12]}..., now {migration.sha256[:12]}...); "
                                 f"add a new migration instead of editing a shipped one")
    newest_known = max((m.version for m in migrations), default=0)
    unknown = sorted(v for v in applied if v > newest_known)
    if unknown:
        raise MigrationError(f"database has {owner} migrations {unknown} newer than this code "
                             f"(newest {newest_known}): deploy the newer code")
