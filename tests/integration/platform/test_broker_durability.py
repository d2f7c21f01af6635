"""The embedded broker keeps its data in the run's data dir: SIGKILL loses no acknowledged message.

Set up as `baton serve --data-dir` does (`EmbeddedInfra` with a work dir; Postgres and Redis are the
session's, given by URL): produce with the usage topic's own client settings (idempotent, acks=all),
SIGKILL the broker, let `baton serve`'s supervisor restart it, and read every acknowledged message back; a
consumer group's committed offsets must survive too. Then the same with the broker and
its store both killed and a new `EmbeddedInfra` on the same directory (`baton serve` started again).
The group's offsets are committed and read back without joining the group (a join takes ~20 s here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, Consumer, Producer, TopicPartition

from services.billing.topic import UsageTopic
from services.launcher.infra import EmbeddedInfra, InfraConfig
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.supervisor import Supervisor

pytestmark = pytest.mark.timeout(120)

GROUP = "durability-check"


@pytest.fixture
def infra_config(tmp_path: Path, postgres: EmbeddedPostgres, redis_server: EmbeddedRedis) -> InfraConfig:
    return InfraConfig(database_url=postgres.url, redis_url=redis_server.url, work_dir=tmp_path / "infra")


@pytest.fixture
def infra(infra_config: InfraConfig) -> Iterator[EmbeddedInfra]:
    infra = EmbeddedInfra(infra_config)
    infra.start()
    yield infra
    infra.stop()


def _produce(topic: UsageTopic, count: int, start: int = 0) -> set[bytes]:
    """Send `count` messages; returns those the broker acknowledged."""
    acked: set[bytes] = set()

    def on_delivery(err: object, msg: object) -> None:
        if err is None:
            acked.add(msg.value())  # type: ignore[attr-defined]

    producer = Producer({**topic.producer_config(delivery_timeout_ms=20_000), "log_level": 0})
    for i in range(start, start + count):
        producer.produce(topic.name, key=str(i % 5).encode(), value=f"event-{i}".encode(), on_delivery=on_delivery)
        producer.poll(0)
    assert producer.flush(30) == 0
    return acked


def _consumer(topic: UsageTopic) -> Consumer:
    # Partitions are assigned, not subscribed: a group join costs ~20 s on this broker, and the group's
    # committed offsets are read and written without one.
    return Consumer({**topic.consumer_config(GROUP), "log_level": 0})


def _partitions(topic: UsageTopic, offset: int = OFFSET_BEGINNING) -> list[TopicPartition]:
    return [TopicPartition(topic.name, p, offset) for p in range(topic.partitions)]


def _read_all(topic: UsageTopic, expected: int, timeout_s: float = 30.0) -> dict[bytes, TopicPartition]:
    """Every message from the start of each partition (stops at `expected` or the timeout), with the
    position after it."""
    consumer = _consumer(topic)
    consumer.assign(_partitions(topic))
    got: dict[bytes, TopicPartition] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            value, partition, offset = msg.value(), msg.partition(), msg.offset()
            assert value is not None and partition is not None and offset is not None
            got[value] = TopicPartition(topic.name, partition, offset + 1)
    finally:
        consumer.close()
    return got


def _commit_after(topic: UsageTopic, read: dict[bytes, TopicPartition]) -> list[tuple[int, int]]:
    """Commit the group's offsets just after the messages read; returns them by partition."""
    ends = {p: max((tp.offset for tp in read.values() if tp.partition == p), default=OFFSET_INVALID)
            for p in range(topic.partitions)}
    consumer = _consumer(topic)
    try:
        consumer.commit(offsets=[TopicPartition(topic.name, p, o) for p, o in ends.items()], asynchronous=False)
    finally:
        consumer.close()
    return sorted(ends.items())


def _committed(topic: UsageTopic) -> list[tuple[int, int]]:
    consumer = _consumer(topic)
    try:
        return [(tp.partition, tp.offset) for tp in consumer.committed(_partitions(topic), timeout=10)]
    finally:
        consumer.close()


def _topic(infra: EmbeddedInfra) -> UsageTopic:
    topic = UsageTopic(infra.endpoints.kafka_bootstrap, partitions=2)
    topic.ensure_exists()
    return topic


def test_sigkilled_broker_restarts_with_every_acknowledged_message(infra: EmbeddedInfra, tmp_path: Path) -> None:
    assert infra.kafka is not None and infra.kafka_store is not None
    topic = _topic(infra)
    first = _produce(topic, 60)
    read = _read_all(topic, expected=60)
    assert set(read) == first and len(first) == 60
    committed = _commit_after(topic, read)
    second = _produce(topic, 40, start=60)

    supervisor = Supervisor(tmp_path / "logs")  # as `baton serve` watches its infrastructure
    for name, service in infra.embedded_by_name().items():
        supervisor.watch_service(name, service)
    infra.kafka.kill()  # SIGKILL: no shutdown, nothing flushed on the way out
    assert not infra.kafka.alive()
    deadline = time.monotonic() + 20
    while supervisor.restarts().get("kafka", 0) == 0 and time.monotonic() < deadline:
        supervisor.poll_restarts()  # restarts it after its backoff: same port, same storage
        time.sleep(0.1)
    assert infra.kafka.alive() and supervisor.restarts()["kafka"] == 1

    assert set(_read_all(topic, expected=100)) == first | second
    assert _committed(topic) == committed


def test_new_run_on_the_same_data_dir_reads_what_the_killed_one_acknowledged(
        infra_config: InfraConfig) -> None:
    first_run = EmbeddedInfra(infra_config)
    first_run.start()
    try:
        acked = _produce(_topic(first_run), 50)
        assert first_run.kafka is not None and first_run.kafka_store is not None
        first_run.kafka.kill()
        first_run.kafka_store.kill()  # the whole run dies (e.g. kill -9 of `baton serve` and its children)
    finally:
        first_run.stop()

    second_run = EmbeddedInfra(infra_config)
    second_run.start()
    try:
        assert set(_read_all(_topic(second_run), expected=len(acked))) == acked
    finally:
        second_run.stop()
    assert (infra_config.work_dir / "kafka-store" / "data" / "tansu").is_dir()  # type: ignore[operator]


def test_broker_waits_out_a_sigkilled_store(infra: EmbeddedInfra) -> None:
    """Messages sent while the store is down are acknowledged once it is back, and none is lost."""
    assert infra.kafka is not None and infra.kafka_store is not None
    topic = _topic(infra)
    before = _produce(topic, 20)
    infra.kafka_store.kill()
    acked: set[bytes] = set()
    failed: list[object] = []

    def on_delivery(err: object, msg: object) -> None:
        if err is not None:
            failed.append(err)
        else:
            acked.add(msg.value())  # type: ignore[attr-defined]

    producer = Producer({**topic.producer_config(delivery_timeout_ms=20_000), "log_level": 0})
    for i in range(20, 40):
        producer.produce(topic.name, key=str(i % 5).encode(), value=f"event-{i}".encode(), on_delivery=on_delivery)
    producer.poll(2.0)  # the broker cannot write them yet
    assert not acked
    infra.kafka_store.start()  # from this (the main) thread: a child dies with the thread that started it
    assert producer.flush(30) == 0
    assert not failed and len(acked) == 20
    assert set(_read_all(topic, expected=40)) == before | acked
