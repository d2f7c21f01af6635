"""`ApiKeyStore`: API key rows. Only the SHA-256 of a key is stored; the key itself never reaches SQL."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from psycopg import errors as pg_errors

from scheduler.types import Tier
from services.common.errors import InvalidRequestError, NotFoundError
from services.gateway.db.pool import Database, returned

_KEY_COLUMNS = ("k.id, k.org_id, k.user_id, k.prefix, k.name, k.created_at, k.revoked_at, "
                "k.rpm_limit, k.tpm_limit")


@dataclass(frozen=True)
class ApiKeyRecord:
    id: uuid.UUID
    org_id: uuid.UUID
    user_id: uuid.UUID | None
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None
    rpm_limit: int | None  # None: the tier's default
    tpm_limit: int | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class KeyWithTier:
    """A key and its organisation's tier: what authentication needs, in one round trip."""

    key: ApiKeyRecord
    tier: Tier


class ApiKeyStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def insert(self, org_id: uuid.UUID, key_hash: bytes, prefix: str, *, user_id: uuid.UUID | None,
                     name: str | None, rpm_limit: int | None, tpm_limit: int | None) -> ApiKeyRecord:
        try:
            async with self._db.connection() as conn:
                cur = await conn.execute(
                    "INSERT INTO api_keys AS k "
                    "(org_id, user_id, key_hash, prefix, name, rpm_limit, tpm_limit) "
                    f"VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING {_KEY_COLUMNS}",
                    (org_id, user_id, key_hash, prefix, name, rpm_limit, tpm_limit))
                return ApiKeyRecord(*returned(await cur.fetchone()))
        except pg_errors.ForeignKeyViolation as e:
            raise NotFoundError(f"organisation {org_id} or user {user_id} not found") from e
        except pg_errors.CheckViolation as e:
            raise InvalidRequestError(f"invalid key limits: {e.diag.message_primary}") from e

    async def find_by_hash(self, key_hash: bytes) -> KeyWithTier | None:
        """The key with this hash, revoked or not (the caller decides), with its org's tier."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_KEY_COLUMNS}, o.tier FROM api_keys k JOIN organisations o ON o.id = k.org_id "
                "WHERE k.key_hash = %s", (key_hash,))
            row = await cur.fetchone()
        if row is None:
            return None
        return KeyWithTier(ApiKeyRecord(*row[:-1]), row[-1])

    async def revoke(self, key_id: uuid.UUID) -> ApiKeyRecord:
        """Mark revoked now; revoking again keeps the first revocation time."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                "UPDATE api_keys AS k SET revoked_at = COALESCE(revoked_at, now()) WHERE id = %s "
                f"RETURNING {_KEY_COLUMNS}", (key_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"API key {key_id} not found")
        return ApiKeyRecord(*row)

    async def find_by_prefix(self, prefix: str) -> list[ApiKeyRecord]:
        """Keys whose display prefix starts with `prefix` (operators identify keys by what they see)."""
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE k.prefix LIKE %s ORDER BY k.created_at",
                (prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",))
            return [ApiKeyRecord(*row) for row in await cur.fetchall()]

    async def list_for_org(self, org_id: uuid.UUID) -> list[ApiKeyRecord]:
        async with self._db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_KEY_COLUMNS} FROM api_keys k WHERE k.org_id = %s ORDER BY k.created_at", (org_id,))
            return [ApiKeyRecord(*row) for row in await cur.fetchall()]
