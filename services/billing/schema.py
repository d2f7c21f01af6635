"""Billing's schema: the usage ledger (`usage_events`, `usage_daily`) and the usage outbox the gateway
writes through billing's `UsageOutbox` (`migrations/*.sql` beside this file).

Billing code applies it wherever it runs against Postgres: the consumer at start, and the outbox side
inside the gateway process (services/gateway/tenancy/backends.py starts it) -- the gateway's own migrations
never touch these tables.
"""

from __future__ import annotations

from services.common.migrations import MigrationSet, SchemaOwner, apply_migrations

BILLING_SCHEMA = MigrationSet(SchemaOwner.BILLING, "services.billing")


def migrate_billing(conninfo: str) -> list[str]:
    """Bring billing's tables to their newest version; returns the names applied now."""
    return apply_migrations(conninfo, BILLING_SCHEMA)
