"""`UsageConsumer`: reads usage events from Kafka into Postgres, exactly one row per request id.

The loop: take a batch, write it in ONE Postgres transaction (`UsageLedger.record`), and only after
that transaction commits, commit the batch's Kafka offsets. A crash anywhere in between means the
batch is read again by whoever owns the partitions next, and the ledger's
`ON CONFLICT (request_id) DO NOTHING` makes that harmless. So: at-least-once reading, exactly-once
rows and aggregates.

A batch whose write fails because Postgres is unreachable is retried (same batch, with backoff) until
it succeeds or the consumer is stopped; stopping then leaves its offsets uncommitted. A batch that
Postgres rejects as data (e.g. an integer out of range) is written event by event, and only the
events that still fail are skipped, with an error log: one bad event must not stall billing.
Messages that are not valid usage events are skipped the same way.

Stopping drains: after `stop` is set the consumer keeps reading until the topic has nothing more for
it (one empty poll) or `drain_timeout_s` passes, so an ordered shutdown (gateway first, then billing,
then the broker) bills everything the gateway handed over. `baton_billing_lag_seconds` is the age of
the oldest event in the last batch written (0 while idle): how far billing is behind.

Progress: at most once a second the consumer records in `billing_consumer_progress` that it is alive
and, after an empty poll, that it had read everything the broker held for it. The outbox relay uses
that to tell a message the broker lost (published before the consumer caught up, yet not in the
ledger) from one still on its way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from prometheus_client import Counter, Gauge

from services.billing.events import UsageEvent
from services.billing.ledger import UsageLedger
from services.billing.topic import UsageTopic
from services.common.errors import BillingError, ConfigError
from services.common.settings import BatonSettings
from services.common.tracing import traced

log = logging.getLogger(__name__)

_PROGRESS_SQL = """
INSERT INTO billing_consumer_progress (member, caught_up_at, seen_at)
VALUES (%(member)s, CASE WHEN %(caught_up)s THEN now() END, now())
ON CONFLICT (member) DO UPDATE SET seen_at = excluded.seen_at,
    caught_up_at = COALESCE(excluded.caught_up_at, billing_consumer_progress.caught_up_at)
"""

EVENTS = Counter("baton_billing_events", "Usage events consumed, by outcome", ["outcome"])
LAG = Gauge("baton_billing_lag_seconds", "Age of the oldest usage event in the last batch written (0: idle)")


@dataclass(frozen=True)
class ConsumerConfig:
    topic: UsageTopic
    database_url: str
    group_id: str = "baton-billing"
    batch_size: int = 500
    poll_timeout_s: float = 0.5
    db_retry_backoff_s: float = 1.0
    drain_timeout_s: float = 10.0  # after stop: keep consuming until caught up, at most this long
    progress_interval_s: float = 1.0  # how often `billing_consumer_progress` is updated

    @classmethod
    def from_settings(cls, settings: BatonSettings, database_url: str | None = None,
                      bootstrap: str | None = None) -> ConsumerConfig:
        """Explicit URLs override the settings (embedded services started by the launcher)."""
        url = database_url or settings.database_url
        if not url:
            raise ConfigError("no database: set BATON_DATABASE_URL")
        return cls(UsageTopic.from_settings(settings, bootstrap), url, settings.billing_group_id,
                   settings.billing_batch_size)


class UsageConsumer:
    def __init__(self, config: ConsumerConfig, ledger: UsageLedger) -> None:
        self.config = config
        self._ledger = ledger
        self._conn: psycopg.Connection | None = None
        self._member = f"{socket.gethostname()}:{os.getpid()}"
        self._progress_at = 0.0

    def run(self, stop: threading.Event) -> None:
        """Consume until `stop` is set; then leave the group cleanly."""
        self.config.topic.ensure_exists()
        consumer = Consumer({**self.config.topic.consumer_config(self.config.group_id), "logger": log})
        consumer.subscribe([self.config.topic.name])
        try:
            while not stop.is_set():
                messages = consumer.consume(self.config.batch_size, self.config.poll_timeout_s)
                if messages:
                    self._handle(consumer, messages, stop)
                else:
                    LAG.set(0)
                self._record_progress(caught_up=not messages)
            self._drain(consumer)
        finally:
            consumer.close()
            if self._conn is not None:
                self._conn.close()

    def _drain(self, consumer: Consumer) -> None:
        """Consume what is left (until an empty poll) within `drain_timeout_s`."""
        deadline = threading.Event()
        timer = threading.Timer(self.config.drain_timeout_s, deadline.set)
        timer.start()
        drained = 0
        try:
            while not deadline.is_set():
                messages = consumer.consume(self.config.batch_size, self.config.poll_timeout_s)
                if not messages:
                    break
                self._handle(consumer, messages, deadline)
                drained += len(messages)
        finally:
            timer.cancel()
        log.info("stopping: drained %d more usage events%s", drained,
                 " (timed out)" if deadline.is_set() else "")

    def _handle(self, consumer: Consumer, messages: Sequence[Message], stop: threading.Event) -> None:
        events: list[UsageEvent] = []
        for msg in messages:
            if msg.error():
                log.warning("kafka: %s", msg.error())
                continue
            try:
                events.append(UsageEvent.from_json(msg.value() or b""))
            except BillingError as e:
                EVENTS.labels("invalid").inc()
                log.error("skipping message at %s[%s]@%s: %s", msg.topic(), msg.partition(), msg.offset(), e)
        if not self._write(events, stop):
            return  # stopped before Postgres took the batch: leave the offsets for the next owner
        if events:
            now = datetime.now(UTC)
            LAG.set(max(0.0, max((now - e.created_at).total_seconds() for e in events)))
        self._commit(consumer, messages)

    @traced("billing.write_batch")
    def _write(self, events: list[UsageEvent], stop: threading.Event) -> bool:
        one_by_one = False
        while not stop.is_set():
            try:
                if one_by_one:
                    self._record_one_by_one(events)
                else:
                    self._record(events)
                return True
            except psycopg.OperationalError as e:
                log.warning("postgres unavailable, retrying the batch in %.1fs: %s",
                            self.config.db_retry_backoff_s, e)
                self._drop_connection()
                stop.wait(self.config.db_retry_backoff_s)
            except psycopg.Error as e:
                log.error("postgres rejected a batch of %d, writing one by one: %s", len(events), e)
                one_by_one = True
        return False

    def _record_progress(self, caught_up: bool) -> None:
        """Alive (and, after an empty poll, caught up) as of now; throttled, never fatal."""
        now = time.monotonic()
        if now - self._progress_at < self.config.progress_interval_s:
            return
        self._progress_at = now
        try:
            self._connection().execute(_PROGRESS_SQL, {"member": self._member, "caught_up": caught_up})
        except psycopg.Error as e:  # Postgres down: the batch writes retry and log; progress just waits
            log.debug("consumer progress not recorded: %s", e)
            self._drop_connection()

    def _record(self, events: list[UsageEvent]) -> None:
        if not events:
            return
        result = self._ledger.record(self._connection(), events)
        EVENTS.labels("inserted").inc(result.inserted)
        EVENTS.labels("duplicate").inc(result.duplicates)

    def _record_one_by_one(self, events: list[UsageEvent]) -> None:
        for event in events:
            try:
                self._record([event])
            except psycopg.OperationalError:
                raise
            except psycopg.Error as e:
                EVENTS.labels("invalid").inc()
                log.error("skipping usage event %s rejected by postgres: %s", event.request_id, e)

    def _commit(self, consumer: Consumer, messages: Sequence[Message]) -> None:
        next_offsets: dict[tuple[str, int], int] = {}
        for msg in messages:
            if msg.error() is None:
                key = (msg.topic() or "", msg.partition() or 0)
                next_offsets[key] = max(next_offsets.get(key, 0), (msg.offset() or 0) + 1)
        if not next_offsets:
            return
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in next_offsets.items()],
                            asynchronous=False)
        except KafkaException as e:
            # E.g. a rebalance took the partitions: their new owner re-reads and the ledger dedupes.
            log.warning("offset commit failed (events will be re-read, harmlessly): %s", e)

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.config.database_url, connect_timeout=5, autocommit=True)
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
