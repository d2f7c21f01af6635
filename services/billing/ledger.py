"""`UsageLedger`: writes a batch of usage events and the daily aggregates in ONE transaction.

Exactly-once rows: `usage_events.request_id` is the primary key and the insert is
`ON CONFLICT (request_id) DO NOTHING`; the aggregate upsert sums only the rows that the insert
really returned, in the same statement. So replaying any batch, any number of times, changes
nothing, and `usage_daily` always equals the sums over `usage_events`.

Aggregate rows are upserted in (org, day, model) order, so two consumers writing overlapping
batches lock them in the same order and cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from services.billing.events import UsageEvent
from services.billing.pricing import PriceTable

_RECORD_SQL = """
WITH incoming AS (
    SELECT * FROM unnest(%(request_id)s::text[], %(org_id)s::uuid[], %(api_key_id)s::uuid[],
                         %(model)s::text[], %(prompt)s::int[], %(cached)s::int[], %(completion)s::int[],
                         %(finish)s::text[], %(ttft)s::float8[], %(e2e)s::float8[], %(cost)s::numeric[],
                         %(created)s::timestamptz[])
        AS t(request_id, org_id, api_key_id, model, prompt_tokens, cached_tokens, completion_tokens,
             finish_reason, ttft_ms, e2e_ms, cost_usd, created_at)
), inserted AS (
    INSERT INTO usage_events (request_id, org_id, api_key_id, model, prompt_tokens, cached_tokens,
                              completion_tokens, finish_reason, ttft_ms, e2e_ms, cost_usd, created_at)
    SELECT * FROM incoming
    ON CONFLICT (request_id) DO NOTHING
    RETURNING org_id, created_at, model, prompt_tokens, cached_tokens, completion_tokens, cost_usd
), daily AS (
    INSERT INTO usage_daily AS d (org_id, day, model, requests, prompt_tokens, cached_tokens,
                                  completion_tokens, cost_usd)
    SELECT org_id, (created_at AT TIME ZONE 'UTC')::date, model, count(*), sum(prompt_tokens),
           sum(cached_tokens), sum(completion_tokens), sum(cost_usd)
    FROM inserted GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (org_id, day, model) DO UPDATE SET
        requests = d.requests + EXCLUDED.requests,
        prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cost_usd = d.cost_usd + EXCLUDED.cost_usd
    RETURNING 1
)
SELECT (SELECT count(*) FROM inserted), (SELECT count(*) FROM daily)
"""


@dataclass(frozen=True)
class RecordResult:
    inserted: int  # new rows
    duplicates: int  # events whose request id was already billed (or repeated within the batch)


class UsageLedger:
    def __init__(self, prices: PriceTable) -> None:
        self._prices = prices

    def record(self, conn: psycopg.Connection, events: Sequence[UsageEvent]) -> RecordResult:
        """Insert `events` and update aggregates in one transaction on `conn` (committed on return)."""
        unique = list({e.request_id: e for e in reversed(events)}.values())  # first occurrence wins
        if not unique:
            return RecordResult(0, len(events))
        with conn.transaction():
            row = conn.execute(_RECORD_SQL, self._columns(unique)).fetchone()
        inserted = int(row[0]) if row else 0
        return RecordResult(inserted, len(events) - inserted)

    def _columns(self, events: list[UsageEvent]) -> dict[str, list[object]]:
        return {
            "request_id": [e.request_id for e in events], "org_id": [e.org_id for e in events],
            "api_key_id": [e.api_key_id for e in events], "model": [e.model for e in events],
            "prompt": [e.prompt_tokens for e in events], "cached": [e.cached_tokens for e in events],
            "completion": [e.completion_tokens for e in events],
            "finish": [e.finish_reason for e in events], "ttft": [e.ttft_ms for e in events],
            "e2e": [e.e2e_ms for e in events], "cost": [self._prices.cost(e) for e in events],
            "created": [e.created_at for e in events],
        }
