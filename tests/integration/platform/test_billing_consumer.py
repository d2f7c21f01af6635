"""The billing consumer in-process: bad messages are skipped without stalling, offsets follow Postgres."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import psycopg
from billing_harness import KAFKA_TEST_CONSUMER_CONFIG, uncommitted_messages, wait_for
from confluent_kafka import Producer

from services.billing.consumer import ConsumerConfig, UsageConsumer
from services.billing.events import UsageEvent
from services.billing.ledger import UsageLedger
from services.billing.pricing import ModelPrice, PriceTable
from services.billing.producer import ProducerConfig, UsageProducer
from services.billing.topic import UsageTopic
from services.launcher.tansu import EmbeddedKafka

PRICES = PriceTable({}, fallback=ModelPrice(Decimal("0.001"), Decimal("0.0005"), Decimal("0.002")))


def _event(i: int) -> UsageEvent:
    return UsageEvent(f"ok-{i}", uuid.UUID(int=7), None, "m", 10, 0, 5, "stop", 1.0, 2.0,
                      datetime(2026, 1, 1, tzinfo=UTC))


def _rows(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return sorted(r[0] for r in conn.execute("SELECT request_id FROM usage_events"))


def test_poison_messages_are_skipped_and_the_rest_billed(database_url: str,
                                                         kafka_broker: EmbeddedKafka) -> None:
    topic = UsageTopic(kafka_broker.url, f"usage-{uuid.uuid4().hex[:8]}",
                       extra_consumer=dict(KAFKA_TEST_CONSUMER_CONFIG))
    topic.ensure_exists()
    raw = Producer({"bootstrap.servers": kafka_broker.url})
    for value in (b"not json", b'{"v": 99}', b'{"v": 1, "request_id": "half"}'):
        raw.produce(topic.name, value=value)
    assert raw.flush(10) == 0
    producer = UsageProducer(ProducerConfig(topic, delivery_timeout_ms=5000))
    producer.start()
    for i in range(30):
        producer.emit(_event(i))
    assert producer.close(10) == []

    group = f"g-{uuid.uuid4().hex[:6]}"
    consumer = UsageConsumer(ConsumerConfig(topic, database_url, group, batch_size=7), UsageLedger(PRICES))
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    try:
        wait_for(lambda: uncommitted_messages(topic, group) == 0, "the consumer to commit everything",
                 lambda: "(in-process consumer)")
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()
    assert _rows(database_url) == sorted(f"ok-{i}" for i in range(30))
