"""`AccountStore`: organisations and their users."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from psycopg import errors as pg_errors

from scheduler.types import Tier
from services.common.errors import InvalidRequestError, NotFoundError
from services.common.settings import TIERS
from services.gateway.db.pool import Database, returned

_ORG_COLUMNS = "id, name, tier, monthly_budget_usd, created_at"


@dataclass(frozen=True)
class Organisation:
    id: uuid.UUID
    name: str
    tier: Tier
    monthly_budget_usd: Decimal | None  # None: no budget
    created_at: datetime


@dataclass(frozen=True)
class User:
    id: uuid.UUID
    org_id: uuid.UUID
    email: str
    name: str | None


def _org(row: tuple) -> Organisation:
    return Organisation(*row)


class AccountStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def create_org(self, name: str, tier: Tier = Tier.FREE,
                         monthly_budget_usd: Decimal | None = None) -> Organisation:
        if tier not in TIERS:
            raise InvalidRequestError(f"unknown tier {tier!r}; valid tiers: {list(TIERS)}")
        if monthly_budget_usd is not None and monthly_budget_usd < 0:
            raise InvalidRequestError("monthly_budget_usd must be >= 0")
        try:
            async with self._db.connection() as conn:
                cur = await conn.execute(
                    f"INSERT INTO organisations (name, tier, monthly_budget_usd) VALUES (%s, %s, %s) "
                    f"RETURNING {_ORG_COLUMNS}", (name, tier, monthly_budget_usd))
                return _org(returned(await cur.fetchone()))
        except pg_errors.UniqueViolation as e:
            raise InvalidRequestError(f"an organisation named {name!r} already exists") from e
        except pg_errors.CheckViolation as e:
            raise InvalidRequestError(f"invalid organisation: {e.diag.message_primary}") from e

    async def get_org(self, org_id: uuid.UUID) -> Organisation:
        async with self._db.connection() as conn:
            cur = await conn.execute(f"SELECT {_ORG_COLUMNS} FROM organisations WHERE id = %s", (org_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"organisation {org_id} not found")
        return _org(row)

    async def find_org(self, name_or_id: str) -> Organisation:
        """By id if it parses as a UUID, else by name (what an operator types in `baton admin`)."""
        try:
            return await self.get_org(uuid.UUID(name_or_id))
        except ValueError:
            pass
        async with self._db.connection() as conn:
            cur = await conn.execute(f"SELECT {_ORG_COLUMNS} FROM organisations WHERE name = %s",
                                     (name_or_id,))
            row = await cur.fetchone()
        if row is None:
            raise NotFoundError(f"organisation {name_or_id!r} not found")
        return _org(row)

    async def ensure_user(self, org_id: uuid.UUID, email: str, name: str | None = None) -> User:
        """The org's user with this email, created if absent (idempotent, race-free upsert)."""
        try:
            async with self._db.connection() as conn:
                cur = await conn.execute(
                    "INSERT INTO users (org_id, email, name) VALUES (%s, %s, %s) "
                    "ON CONFLICT (org_id, email) DO UPDATE SET name = COALESCE(EXCLUDED.name, users.name) "
                    "RETURNING id, org_id, email, name", (org_id, email, name))
                return User(*returned(await cur.fetchone()))
        except pg_errors.ForeignKeyViolation as e:
            raise NotFoundError(f"organisation {org_id} not found") from e
        except pg_errors.CheckViolation as e:
            raise InvalidRequestError(f"invalid user: {e.diag.message_primary}") from e

