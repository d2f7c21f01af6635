"""Billing end to end: producer -> Kafka (Tansu) -> consumer subprocess -> Postgres, exactly one row
per request id through a consumer SIGKILL, a broker restart (which wipes its memory storage), a
consumer restart and replayed duplicates; and aggregates equal to the sums of the rows.

What the scenario relies on (and the producer documents): an event is safe once a broker acknowledged
it AND, with Tansu's memory storage, once the consumer committed it to Postgres. So the broker is
restarted only after the consumer has drained the topic; events emitted while the broker is down are
held by the producer and delivered when it returns.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
from billing_harness import ConsumerProcess, uncommitted_messages, wait_for

from services.billing.events import UsageEvent
from services.billing.pricing import PriceTable
from services.billing.producer import ProducerConfig, UsageProducer
from services.billing.topic import UsageTopic
from services.common.settings import BatonSettings
from services.launcher.tansu import EmbeddedKafka

ORGS = [uuid.UUID(int=1), uuid.UUID(int=2)]
MODELS = ["smollm2-135m", "llama-3.2-1b"]
DAY0 = datetime(2026, 3, 31, 23, 0, tzinfo=UTC)  # events straddle a UTC day (and month) boundary


def _event(i: int) -> UsageEvent:
    return UsageEvent(request_id=f"req-{i:05d}", org_id=ORGS[i % 2], api_key_id=uuid.UUID(int=100 + i % 3),
                      model=MODELS[i % 2], prompt_tokens=100 + i, cached_tokens=(i * 7) % 50,
                      completion_tokens=1 + (i * 13) % 200,
                      finish_reason="abort" if i % 10 == 0 else "stop", ttft_ms=12.5, e2e_ms=250.0,
                      created_at=DAY0 + timedelta(minutes=i))


def _row_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM usage_events").fetchone()
        return int(row[0]) if row else 0


def _emit_paced(producer: UsageProducer, events: list[UsageEvent], pause_s: float,
                hold_at: int, release: threading.Event) -> threading.Thread:
    """Emit in the background; before event `hold_at`, wait for `release`, so whatever happens while
    it is held (the consumer's SIGKILL) happens mid-stream on a machine of any speed."""
    def run() -> None:
        for i, event in enumerate(events):
            if i == hold_at:
                release.wait(60)
            producer.emit(event)
            time.sleep(pause_s)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _assert_ledger(url: str, expected: list[UsageEvent]) -> None:
    prices = PriceTable.from_settings(BatonSettings())
    with psycopg.connect(url) as conn:
        ids = [r[0] for r in conn.execute("SELECT request_id FROM usage_events")]
        daily = {(r[0], r[1], r[2]): tuple(r[3:]) for r in conn.execute(
            "SELECT org_id, day, model, requests, prompt_tokens, cached_tokens, completion_tokens, cost_usd "
            "FROM usage_daily")}
        from_rows = {(r[0], r[1], r[2]): tuple(r[3:]) for r in conn.execute(
            "SELECT org_id, (created_at AT TIME ZONE 'UTC')::date, model, count(*), sum(prompt_tokens), "
            "sum(cached_tokens), sum(completion_tokens), sum(cost_usd) FROM usage_events GROUP BY 1, 2, 3")}
    assert daily == from_rows  # the aggregate table equals the sums over the ledger's rows
    assert sorted(ids) == sorted(e.request_id for e in expected)  # every request exactly once
    sums: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, 0, Decimal(0)])
    for e in expected:
        s = sums[(e.org_id, e.created_at.astimezone(UTC).date(), e.model)]
        s[0] += 1
        s[1] += e.prompt_tokens
        s[2] += e.cached_tokens
        s[3] += e.completion_tokens
        s[4] += prices.cost(e)
    assert daily == {k: tuple(v) for k, v in sums.items()}


def test_every_request_billed_exactly_once_through_crashes_and_broker_restart(
        database_url: str, kafka_broker: EmbeddedKafka, tmp_path: Path) -> None:
    broker = kafka_broker  # restarted below: other tests use their own topics and survive that
    topic = UsageTopic(broker.url, f"usage-{uuid.uuid4().hex[:8]}")
    group = "billing-test"
    producer = UsageProducer(ProducerConfig(topic, delivery_timeout_ms=3000, retry_backoff_s=0.2))
    consumer = ConsumerProcess(database_url, topic, group, tmp_path / "consumer.log")
    try:
        producer.start()
        phase1 = [_event(i) for i in range(400)]
        replays = [phase1[i] for i in range(0, 400, 4)]  # 100 duplicates, emitted after their originals
        consumer.start()
        killed = threading.Event()
        emitter = _emit_paced(producer, phase1 + replays, pause_s=0.004, hold_at=350, release=killed)
        wait_for(lambda: _row_count(database_url) >= 60, "the first consumer to bill 60 events",
                 consumer.log_tail)
        consumer.kill()  # SIGKILL mid-stream: batches in hand are written but uncommitted, or unwritten
        killed.set()
        emitter.join()
        assert producer.flush(30) == 0

        consumer.start()  # a successor re-reads from the last committed offsets
        wait_for(lambda: uncommitted_messages(topic, group) == 0, "the successor to drain the topic",
                 consumer.log_tail)
        assert _row_count(database_url) == 400
        assert consumer.terminate() == 0  # SIGTERM: clean exit

        broker.stop()  # memory storage: topic, messages and group offsets are gone
        phase2 = [_event(i) for i in range(400, 450)]
        for event in phase2:
            producer.emit(event)  # held by the producer while the broker is down
        time.sleep(0.5)
        broker.start()  # same address
        assert producer.flush(30) == 0

        consumer.start()
        phase3 = [_event(i) for i in range(450, 500)] + phase1[:30] + phase2[:10]
        for event in phase3:
            producer.emit(event)
        assert producer.flush(30) == 0
        wait_for(lambda: uncommitted_messages(topic, group) == 0, "the consumer to drain after the restart",
                 consumer.log_tail)
        _assert_ledger(database_url, [_event(i) for i in range(500)])
        assert consumer.terminate() == 0
    finally:
        consumer.kill()
        producer.close(timeout_s=1)
        if not broker.alive():
            broker.start()
