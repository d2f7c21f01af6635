"""`UsageOutbox`: the gateway's side of billing. A finished request's usage is made durable before its
response ends; publishing it to Kafka is the relay's job (relay.py).

`record(event)` inserts one `usage_outbox` row (`ON CONFLICT (request_id) DO NOTHING`: recording the
same request twice is harmless). When Postgres cannot take it within `record_timeout_s` (down,
pool exhausted), the event is appended to the local `UsageSpool` instead (fsynced), which the relay
drains into the table later. Only when both fail (Postgres down AND the spool's disk unwritable) is
the event lost; that is logged as an error and counted in `baton_billing_usage_lost_total`.

The outbox is also a Prometheus collector (registered on the gateway's `/metrics`): the relay's
view of the backlog (`baton_billing_outbox_unsent`, `baton_billing_outbox_unbilled`,
`baton_billing_outbox_lag_seconds`, `baton_billing_spool_bytes`,
`baton_billing_outbox_republished_total`) and the two counters above.

The gateway awaits `record` before it sends a stream's final `[DONE]` or a non-streamed response,
so every request a client saw complete has its usage in Postgres or on the gateway's disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.billing.events import UsageEvent
from services.billing.outbox_table import INSERT_SQL, AsyncConnections, insert_params
from services.billing.relay import OutboxRelay
from services.billing.spool import UsageSpool
from services.common.errors import BatonError

log = logging.getLogger(__name__)

class UsageOutbox:
    def __init__(self, db: AsyncConnections, spool: UsageSpool, relay: OutboxRelay,
                 record_timeout_s: float = 2.0) -> None:
        self._db = db
        self._spool = spool
        self._relay = relay
        self._record_timeout_s = record_timeout_s
        self.spooled = 0  # events written to the spool (Postgres could not take them)
        self.lost = 0  # events neither Postgres nor the spool could take

    async def record(self, event: UsageEvent) -> None:
        """Make `event` durable (outbox row, else spool line); never raises."""
        try:
            async with asyncio.timeout(self._record_timeout_s):
                await self._insert(event)
        except (BatonError, psycopg.Error, TimeoutError) as e:
            await self._spool_instead(event, e)
        self._relay.wake()

    @property
    def pending(self) -> int:
        """Usage events not yet published (as of the relay's last round)."""
        return self._relay.stats.unsent

    async def _insert(self, event: UsageEvent) -> None:
        async with self._db.connection() as conn:
            await conn.execute(INSERT_SQL, insert_params([event]))

    async def _spool_instead(self, event: UsageEvent, why: BaseException) -> None:
        try:
            await asyncio.to_thread(self._spool.append, event)
        except OSError as e:
            self.lost += 1
            log.error("usage of %s LOST: postgres failed (%s) and the spool %s failed (%s)",
                      event.request_id, why, self._spool.path, e)
            return
        self.spooled += 1
        log.warning("usage of %s spooled to %s (postgres: %s)", event.request_id, self._spool.path, why)

    def collect(self) -> Iterator[Metric]:
        stats = self._relay.stats
        for name, help_text, value in (
                ("outbox_unsent", "Outbox rows not yet published to Kafka", stats.unsent),
                ("outbox_unbilled", "Usage events published but not yet in the billing ledger", stats.unbilled),
                ("outbox_lag_seconds", "Age of the oldest usage event not yet in the billing ledger (0: all "
                 "billed)", stats.lag_s),
                ("spool_bytes", "Size of the local usage spool not yet drained into the outbox", stats.spool_bytes)):
            yield GaugeMetricFamily(f"baton_billing_{name}", help_text, value=value)
        for name, help_text, value in (
                ("outbox_republished", "Usage events published again because the ledger never got them (a "
                 "broker lost them)", stats.republished),
                ("usage_spooled", "Usage events written to the local spool (Postgres could not take them)",
                 self.spooled),
                ("usage_lost", "Usage events neither Postgres nor the spool could take", self.lost)):
            yield CounterMetricFamily(f"baton_billing_{name}", help_text, value=value)
