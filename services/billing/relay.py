"""`OutboxRelay`: publishes `usage_outbox` rows to Kafka, in order, and keeps each row until the billing
ledger has it.

One round (looped by the gateway while it runs; woken by each `UsageOutbox.record`, else every
`poll_interval_s`, which is how rows left by a killed gateway are found):
1. Drain the local spool into the outbox table, if anything is spooled (Postgres is back).
2. Claim the oldest unsent rows (`FOR UPDATE SKIP LOCKED`, so gateway replicas never publish the same
   row at once), hand them to the `UsageProducer`, wait up to `publish_timeout_s` for the broker's
   acknowledgements (acks=all) and mark the acknowledged rows sent, all in one transaction. A broker
   that is down acknowledges nothing: the rows stay unsent and the next round tries again (the
   producer keeps re-sending the ones it holds meanwhile).
3. Settle: delete sent rows whose request id is in `usage_events` (billed), and mark unsent again the
   sent rows the ledger still lacks although billing has moved on since they were sent: either every
   live consumer has since read all the broker held for it (an empty poll, recorded in
   `billing_consumer_progress` — services/billing/consumer.py), or the ledger has ingested events for
   `confirm_timeout_s` since. That is a broker that lost acknowledged messages (the embedded Tansu
   keeps them in memory only, so a restart loses them). While billing is down neither happens and
   nothing is re-published. (Ledger progress alone left rows lost just before the load stopped
   unbilled for good: nothing newer was ingested after them.)

At-least-once: a crash between the broker's acknowledgement and the commit, a timed-out insert that
also went to the spool, or a re-publish after a lost broker can each publish a request twice; the
consumer's ledger keeps one row per request id (`ON CONFLICT DO NOTHING`), so each is billed once.

`close` stops the loop and then drains: rounds until no unsent row is left or `drain_timeout_s`
passes. Whatever is left stays in Postgres (or the spool) for the next gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import psycopg

from services.billing.events import UsageEvent
from services.billing.outbox_table import INSERT_SQL, AsyncConnections, insert_params
from services.billing.producer import UsageProducer
from services.billing.spool import UsageSpool
from services.common.errors import BatonError, BillingError, UsageBacklogFullError
from services.common.settings import BatonSettings

log = logging.getLogger(__name__)

_CLAIM_SQL = """
SELECT request_id, event FROM usage_outbox WHERE sent_at IS NULL
ORDER BY recorded_at, request_id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
"""
_MARK_SENT_SQL = "UPDATE usage_outbox SET sent_at = now() WHERE request_id = ANY(%(ids)s)"
_DELETE_BILLED_SQL = """
DELETE FROM usage_outbox o USING usage_events e WHERE o.sent_at IS NOT NULL AND e.request_id = o.request_id
"""
_REPUBLISH_LOST_SQL = """
UPDATE usage_outbox o SET sent_at = NULL, republished = republished + 1
WHERE o.sent_at IS NOT NULL
  AND (o.sent_at < (SELECT max(ingested_at) FROM usage_events) - make_interval(secs => %(confirm_s)s)
       OR o.sent_at < (SELECT min(caught_up_at) FROM billing_consumer_progress
                       WHERE seen_at > now() - make_interval(secs => %(live_s)s)
                       HAVING count(*) = count(caught_up_at)) - make_interval(secs => %(margin_s)s))
  AND NOT EXISTS (SELECT 1 FROM usage_events e WHERE e.request_id = o.request_id)
RETURNING request_id
"""
_STATS_SQL = """
SELECT count(*) FILTER (WHERE sent_at IS NULL), count(*) FILTER (WHERE sent_at IS NOT NULL),
       COALESCE(extract(epoch FROM now() - min(recorded_at)), 0)
FROM usage_outbox
"""


# A consumer counts as live if it polled this recently (it records progress every second; a killed one
# must drop out fast, or its stale row holds re-publishing back); an empty poll counts as caught up with
# rows sent this long before it (the broker had acknowledged them: a live broker would have delivered them).
_CONSUMER_LIVE_S = 5.0
_CAUGHT_UP_MARGIN_S = 2.0


@dataclass(frozen=True)
class RelayConfig:
    database_url: str  # the spool is drained over a connection of its own, in a thread
    batch_size: int = 500
    poll_interval_s: float = 0.5  # idle rounds: rows of other (or killed) gateways are found this fast
    publish_timeout_s: float = 5.0  # a round waits this long for the broker's acknowledgements
    confirm_timeout_s: float = 10.0  # ledger progress after which a published, unbilled row is re-sent
    drain_timeout_s: float = 10.0  # at close
    error_backoff_s: float = 1.0

    @classmethod
    def from_settings(cls, settings: BatonSettings, database_url: str) -> RelayConfig:
        return cls(database_url, confirm_timeout_s=settings.usage_confirm_timeout_s)


@dataclass
class OutboxStats:
    unsent: int = 0  # rows not yet acknowledged by a broker
    unbilled: int = 0  # rows acknowledged, not yet in the ledger
    lag_s: float = 0.0  # age of the oldest row not yet in the ledger
    spool_bytes: int = 0
    republished: int = 0  # rows this relay found lost by the broker and published again


class OutboxRelay:
    def __init__(self, db: AsyncConnections, producer: UsageProducer, spool: UsageSpool,
                 config: RelayConfig) -> None:
        self._db = db
        self._producer = producer
        self._spool = spool
        self.config = config
        self.stats = OutboxStats()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop looping, then drain (see the module doc)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            try:
                await self.round()
            except (BatonError, psycopg.Error) as e:
                log.warning("usage relay drain: %s", e)
                await asyncio.sleep(self.config.error_backoff_s)
                continue
            if self.stats.unsent == 0 and self.stats.spool_bytes == 0:
                return
        log.error("usage relay: %d outbox rows and %d spooled bytes left unpublished at shutdown; the next "
                  "gateway publishes them", self.stats.unsent, self.stats.spool_bytes)

    async def round(self) -> int:
        """One round (see the module doc); returns how many rows a broker acknowledged."""
        if self._spool.size():
            drained = await asyncio.to_thread(self._spool.drain, self._store_spooled)
            log.info("usage spool: %d events moved into the outbox", drained)
        published = await self._publish()
        await self._settle()
        return published

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                published = await self.round()
            except (BatonError, psycopg.Error) as e:
                log.warning("usage relay round failed, retrying in %.1fs: %s", self.config.error_backoff_s, e)
                await asyncio.sleep(self.config.error_backoff_s)
                continue
            if published < self.config.batch_size:  # a full batch: more may be waiting, go on at once
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.poll_interval_s):
                        await self._wake.wait()

    async def _publish(self) -> int:
        async with self._db.connection() as conn:
            cur = await conn.execute(_CLAIM_SQL, {"limit": self.config.batch_size})
            events = await self._readable(conn, await cur.fetchall())
            if not events:
                return 0
            try:
                for event in events:
                    self._producer.emit(event)  # an event the producer still holds is not sent twice
            except UsageBacklogFullError as e:
                log.warning("usage relay: %s", e)
            await asyncio.to_thread(self._producer.flush, self.config.publish_timeout_s)
            held = self._producer.pending_ids()
            acked = [e.request_id for e in events if e.request_id not in held]
            await conn.execute(_MARK_SENT_SQL, {"ids": acked})
        return len(acked)

    @staticmethod
    async def _readable(conn: psycopg.AsyncConnection, rows: list[tuple[str, str]]) -> list[UsageEvent]:
        """The rows' events; a row that is not a valid event (never written by this code) is deleted
        with an error log rather than stall every row behind it."""
        events, bad = [], []
        for request_id, event in rows:
            try:
                events.append(UsageEvent.from_json(event))
            except BillingError as e:
                log.error("usage outbox row %s is unreadable, deleted: %s", request_id, e)
                bad.append(request_id)
        if bad:
            await conn.execute("DELETE FROM usage_outbox WHERE request_id = ANY(%(ids)s)", {"ids": bad})
        return events

    async def _settle(self) -> None:
        async with self._db.connection() as conn:
            await conn.execute(_DELETE_BILLED_SQL)
            cur = await conn.execute(_REPUBLISH_LOST_SQL, {"confirm_s": self.config.confirm_timeout_s,
                                                           "live_s": _CONSUMER_LIVE_S, "margin_s": _CAUGHT_UP_MARGIN_S})
            lost = len(await cur.fetchall())
            cur = await conn.execute(_STATS_SQL)
            row = await cur.fetchone()
        if lost:
            self.stats.republished += lost
            log.warning("usage relay: %d published events never reached the ledger (the broker lost them?); "
                        "publishing them again", lost)
        if row is not None:
            self.stats.unsent, self.stats.unbilled = int(row[0]), int(row[1])
            self.stats.lag_s = float(row[2])
        self.stats.spool_bytes = self._spool.size()

    def _store_spooled(self, events: list[UsageEvent]) -> None:
        with psycopg.connect(self.config.database_url, connect_timeout=5) as conn:
            conn.execute(INSERT_SQL, insert_params(events))
