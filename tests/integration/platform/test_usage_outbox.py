"""The usage outbox end to end on the real Postgres and broker: `UsageOutbox.record` -> `usage_outbox`
-> `OutboxRelay` -> Kafka -> `UsageConsumer` (in a thread) -> ledger; the relay then deletes billed rows.

Covered: a row is durable when `record` returns; a broker that is down, and one that comes back having
lost acknowledged events (Tansu's memory storage); rows left by a dead gateway (some still claimed by
its open transaction) published by the next, with two relays at once; a re-published row billed once;
Postgres down -> the spool -> drained when Postgres is back.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import psycopg
from billing_harness import KAFKA_TEST_CONSUMER_CONFIG, uncommitted_messages
from prometheus_client import REGISTRY, CollectorRegistry

from services.billing.consumer import ConsumerConfig, UsageConsumer
from services.billing.events import UsageEvent
from services.billing.ledger import UsageLedger
from services.billing.outbox import UsageOutbox
from services.billing.pricing import ModelPrice, PriceTable
from services.billing.producer import ProducerConfig, UsageProducer
from services.billing.relay import OutboxRelay, RelayConfig
from services.billing.spool import UsageSpool
from services.billing.topic import UsageTopic
from services.gateway.db.pool import Database, DatabaseConfig
from services.launcher.process import free_port
from services.launcher.tansu import EmbeddedKafka

PRICES = PriceTable({}, fallback=ModelPrice(Decimal("0.001"), Decimal("0.0005"), Decimal("0.002")))
ORG = uuid.UUID(int=42)


def _events(tag: str, n: int) -> list[UsageEvent]:
    return [UsageEvent(f"{tag}-{i:03d}", ORG, None, "m", 10, 2, 5, "stop", 1.0, 2.0, datetime.now(UTC))
            for i in range(n)]


def _ids(events: list[UsageEvent]) -> set[str]:
    return {e.request_id for e in events}


def _topic(broker: EmbeddedKafka) -> UsageTopic:
    topic = UsageTopic(broker.url, f"usage-{uuid.uuid4().hex[:8]}", extra_consumer=dict(KAFKA_TEST_CONSUMER_CONFIG))
    topic.ensure_exists()
    return topic


def _ledger(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT request_id, count(*) FROM usage_events GROUP BY 1")}


def _outbox(url: str) -> dict[str, datetime | None]:
    with psycopg.connect(url) as conn:
        return {r[0]: r[1] for r in conn.execute("SELECT request_id, sent_at FROM usage_outbox")}


@asynccontextmanager
async def _relay(db: Database, topic: UsageTopic, spool_dir: Path) -> AsyncIterator[OutboxRelay]:
    """A gateway's relay (not looping: tests drive its rounds), over a fresh producer."""
    producer = UsageProducer(ProducerConfig(topic, delivery_timeout_ms=2000, retry_backoff_s=0.2))
    producer.start()
    try:
        yield OutboxRelay(db, producer, UsageSpool(spool_dir),
                          RelayConfig(db.config.url, publish_timeout_s=2.0, confirm_timeout_s=0.5))
    finally:
        await asyncio.to_thread(producer.close, 0.5)


@asynccontextmanager
async def _gateway(db: Database, topic: UsageTopic, spool_dir: Path) -> AsyncIterator[tuple[OutboxRelay, UsageOutbox]]:
    """A gateway's billing side: its outbox and its relay."""
    async with _relay(db, topic, spool_dir) as relay:
        yield relay, UsageOutbox(db, UsageSpool(spool_dir), relay)


@contextmanager
def _billing(url: str, topic: UsageTopic, group: str = "billing") -> Iterator[None]:
    consumer = UsageConsumer(ConsumerConfig(topic, url, group, batch_size=20, poll_timeout_s=0.2),
                             UsageLedger(PRICES))
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(20)


async def _rounds_until(relays: list[OutboxRelay], done: Callable[[], bool], what: str,
                        timeout_s: float = 40) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        await asyncio.gather(*(r.round() for r in relays))
        if done():
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _gauges(registry: CollectorRegistry) -> dict[str, float | None]:
    return {name: registry.get_sample_value(f"baton_billing_outbox_{name}")
            for name in ("unsent", "unbilled", "lag_seconds")}


def _billed_once(url: str, ids: set[str]) -> Callable[[], bool]:
    return lambda: _ledger(url) == dict.fromkeys(ids, 1) and not _outbox(url)


async def test_a_row_is_durable_when_record_returns_then_published_billed_and_deleted(
        db: Database, database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    topic = _topic(kafka_broker)
    events = _events("a", 20)
    async with _gateway(db, topic, tmp_path) as (relay, outbox):
        registry = CollectorRegistry()
        registry.register(outbox)
        for event in events:
            await outbox.record(event)
        await outbox.record(events[0])  # the same request again: still one row
        assert _outbox(database_url) == dict.fromkeys(_ids(events))  # all there, none sent yet

        assert await relay.round() == 20  # every row acknowledged by the broker and marked sent
        assert all(_outbox(database_url).values())
        gauges = _gauges(registry)  # as numbers: a lag of 0.084 s printed as text starts with "0.0" too
        assert (gauges["unsent"], gauges["unbilled"]) == (0.0, 20.0)
        assert gauges["lag_seconds"] is not None and gauges["lag_seconds"] > 0.0  # unbilled: billing lags

        with _billing(database_url, topic):
            await _rounds_until([relay], _billed_once(database_url, _ids(events)), "billing")
        gauges = _gauges(registry)
        assert (gauges["unbilled"], gauges["lag_seconds"]) == (0.0, 0.0)


async def test_broker_down_then_back_without_its_messages_loses_no_usage(
        db: Database, database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    topic = _topic(kafka_broker)
    before, during, after = _events("before", 5), _events("during", 5), _events("after", 5)
    try:
        async with _gateway(db, topic, tmp_path) as (relay, outbox):
            for event in before:
                await outbox.record(event)
            assert await relay.round() == 5  # acknowledged ... and not consumed yet:
            kafka_broker.stop()  # memory storage: the topic and those 5 events are gone
            for event in during:
                await outbox.record(event)
            assert await relay.round() == 0  # nothing acknowledged: the rows wait
            assert [sent for rid, sent in _outbox(database_url).items() if rid.startswith("during")] == [None] * 5
            kafka_broker.start()  # same address, empty
            await _rounds_until([relay], lambda: all(_outbox(database_url).values()), "publishing after the outage")
            with _billing(database_url, topic):
                for event in after:
                    await outbox.record(event)
                # The ledger ingests `during` and `after`; `before` was sent long before and never
                # arrived, so the relay publishes it again.
                await _rounds_until([relay], _billed_once(database_url, _ids(before + during + after)),
                                    "billing of every event, the lost ones re-published")
            assert relay.stats.republished >= 5
    finally:
        if not kafka_broker.alive():
            kafka_broker.start()


async def test_events_the_broker_lost_last_are_published_again_once_billing_has_caught_up(
        db: Database, database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    """The chaos run's case: the broker loses the last events of a load, so the ledger ingests nothing
    after them; the consumer's empty polls (billing_consumer_progress) show it has read everything the
    broker holds, which is what lets the relay publish them again."""
    topic = _topic(kafka_broker)
    last = _events("last", 4)
    try:
        async with _gateway(db, topic, tmp_path) as (relay, outbox):
            for event in last:
                await outbox.record(event)
            assert await relay.round() == 4  # acknowledged, then lost with the broker's memory
            kafka_broker.stop()
            kafka_broker.start()
            with _billing(database_url, topic):
                await _rounds_until([relay], _billed_once(database_url, _ids(last)),
                                    "the lost events billed with nothing newer ingested")
            assert relay.stats.republished >= 4
    finally:
        if not kafka_broker.alive():
            kafka_broker.start()


async def test_rows_of_a_dead_gateway_are_published_by_the_next_two_relays_billed_once(
        db: Database, database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    topic = _topic(kafka_broker)
    events = _events("dead", 30)
    async with _gateway(db, topic, tmp_path) as (_, dead):
        for event in events:
            await dead.record(event)  # recorded, then the gateway died before its relay ran
    # A gateway killed mid-round: its transaction still holds 10 claimed rows (until its connection drops).
    killed = psycopg.connect(database_url)
    claimed = killed.execute("SELECT request_id FROM usage_outbox ORDER BY recorded_at, request_id "
                             "LIMIT 10 FOR UPDATE").fetchall()
    async with _relay(db, topic, tmp_path) as one, _relay(db, topic, tmp_path) as two:
        with _billing(database_url, topic):
            await _rounds_until([one, two], lambda: len(_ledger(database_url)) == 20, "the unclaimed rows")
            assert {r[0] for r in claimed}.isdisjoint(_ledger(database_url))  # skipped, not waited for
            killed.close()  # the dead gateway's connection drops: its claims are released
            await _rounds_until([one, two], _billed_once(database_url, _ids(events)), "every row")


async def test_a_row_published_twice_is_billed_once(db: Database, database_url: str,
                                                    kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    topic = _topic(kafka_broker)
    event = _events("twice", 1)[0]
    duplicates = REGISTRY.get_sample_value("baton_billing_events_total", {"outcome": "duplicate"}) or 0
    async with _gateway(db, topic, tmp_path) as (relay, outbox):
        with _billing(database_url, topic, "billing-twice"):
            await outbox.record(event)
            await _rounds_until([relay], _billed_once(database_url, {event.request_id}), "billing")
            await outbox.record(event)  # as after a crash between the broker's ack and marking it sent
            await _rounds_until([relay], lambda: not _outbox(database_url), "the second publish")
            await _rounds_until([relay], lambda: uncommitted_messages(topic, "billing-twice") == 0,
                                "the consumer to read the duplicate")
    assert _ledger(database_url) == {event.request_id: 1}
    assert (REGISTRY.get_sample_value("baton_billing_events_total", {"outcome": "duplicate"}) or 0) > duplicates
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT requests FROM usage_daily").fetchall() == [(1,)]


async def test_postgres_down_spools_and_the_relay_drains_the_spool_when_it_is_back(
        db: Database, database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    topic = _topic(kafka_broker)
    events = _events("spooled", 3)
    down = Database(DatabaseConfig(f"postgresql://baton@127.0.0.1:{free_port()}/gone", min_size=0,
                                   migrate=False, acquire_timeout_s=0.5))
    await down.open()
    spool = UsageSpool(tmp_path / "spool")
    try:
        async with _relay(db, topic, tmp_path / "spool") as relay:
            outbox = UsageOutbox(down, spool, relay, record_timeout_s=1.0)
            for event in events:
                await outbox.record(event)
            assert outbox.spooled == 3 and outbox.lost == 0 and spool.size() > 0
            assert not _outbox(database_url)
            with _billing(database_url, topic):  # the relay (Postgres reachable) drains the spool
                await _rounds_until([relay], _billed_once(database_url, _ids(events)), "the spooled events")
            assert spool.size() == 0
    finally:
        await down.close()
