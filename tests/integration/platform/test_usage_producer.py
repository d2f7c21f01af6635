"""The usage producer never drops an event silently: a backlog is refused loudly, leftovers returned."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from services.billing.events import UsageEvent
from services.billing.producer import ProducerConfig, UsageProducer
from services.billing.topic import UsageTopic
from services.common.errors import UsageBacklogFullError
from services.launcher.process import free_port


def _event(i: int) -> UsageEvent:
    return UsageEvent(f"r-{i}", uuid.uuid4(), None, "m", 1, 0, 1, "stop", None, None, datetime.now(UTC))


def _unreachable_producer(max_pending: int) -> UsageProducer:
    topic = UsageTopic(f"127.0.0.1:{free_port()}", "usage")  # nothing listens there
    producer = UsageProducer(ProducerConfig(topic, delivery_timeout_ms=1000, max_pending=max_pending))
    producer.start()
    return producer


def test_backlog_beyond_the_limit_is_refused() -> None:
    producer = _unreachable_producer(max_pending=3)
    try:
        for i in range(3):
            producer.emit(_event(i))
        with pytest.raises(UsageBacklogFullError):
            producer.emit(_event(3))
        producer.emit(_event(0))  # the same request again is not a new event: accepted
    finally:
        producer.close(timeout_s=0.2)


def test_close_returns_every_unacknowledged_event() -> None:
    producer = _unreachable_producer(max_pending=100)
    events = [_event(i) for i in range(5)]
    for event in events:
        producer.emit(event)
    left = producer.close(timeout_s=0.5)
    assert sorted(e.request_id for e in left) == sorted(e.request_id for e in events)
