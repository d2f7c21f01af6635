"""The gateway's schema: accounts, API keys and conversations (`migrations/*.sql` beside this file).

Billing's tables (the usage ledger and outbox) are billing's own (`services.billing.schema`); the runner
and its bookkeeping are `services.common.migrations`.
"""

from __future__ import annotations

from services.common.migrations import MigrationSet, SchemaOwner, apply_migrations

GATEWAY_SCHEMA = MigrationSet(SchemaOwner.GATEWAY, "services.gateway.db")


def migrate_gateway(conninfo: str) -> list[str]:
    """Bring the gateway's tables to their newest version; returns the names applied now."""
    return apply_migrations(conninfo, GATEWAY_SCHEMA)
