"""The `usage_outbox` table's insert, shared by the outbox (the gateway's writes) and its relay (the spool's drain)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import psycopg

from services.billing.events import UsageEvent

INSERT_SQL = """
INSERT INTO usage_outbox (request_id, event, recorded_at)
SELECT * FROM unnest(%(ids)s::text[], %(events)s::text[], %(at)s::timestamptz[])
ON CONFLICT (request_id) DO NOTHING
"""


def insert_params(events: Sequence[UsageEvent]) -> dict[str, list[object]]:
    return {"ids": [e.request_id for e in events], "events": [e.to_json().decode() for e in events],
            "at": [e.created_at for e in events]}


class AsyncConnections(Protocol):
    """An async pool whose `connection()` block is one transaction (services.gateway.db.pool.Database)."""

    def connection(self) -> AbstractAsyncContextManager[psycopg.AsyncConnection]: ...
