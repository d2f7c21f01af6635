"""`UsageProducer`: the Kafka client of the gateway's outbox relay (relay.py). Publishes `UsageEvent`s
and keeps each one until a broker acknowledged it; the relay marks an outbox row sent only then.

What is guaranteed, precisely:
- `emit()` hands the event to this object's memory and returns at once. From then on, while this
  process lives, the event is re-sent until a broker acknowledges it with acks=all: after delivery
  timeouts, fatal producer errors and broker restarts. `close()` waits (up to its timeout) for the
  rest and returns the events that were never acknowledged, for the caller to log.
- A re-send can duplicate an event the broker already stored (the acknowledgement was lost, or a
  purge raced it). Billing deduplicates by request id, so each request gets at most one row.
- An acknowledged event is exactly as durable as the broker. Replicated Kafka keeps it through
  broker failures; the embedded Tansu broker stores in memory, so a broker restart loses events that
  were acknowledged but not yet consumed. Neither that nor this process dying loses usage: the
  outbox row stays in Postgres until the ledger has it, and the relay publishes it again.

Why rebuild the producer: with `enable.idempotence` the broker tracks our producer id and sequence
numbers. A broker that lost its state (Tansu after a restart) answers UNKNOWN_PRODUCER_ID forever and
librdkafka keeps retrying until `message.timeout.ms`; those events come back as failed deliveries.
Any failed delivery therefore makes the background thread purge the old librdkafka producer and
create a fresh one (new producer id), then re-send every unacknowledged event.

Threads: `emit()` may be called from any thread (the gateway's event loop); one background thread
serves delivery callbacks and does the re-sends.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from confluent_kafka import KafkaError, Message, Producer

from services.billing.events import UsageEvent
from services.billing.topic import UsageTopic
from services.common.errors import BillingError, UsageBacklogFullError
from services.common.settings import BatonSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerConfig:
    topic: UsageTopic
    delivery_timeout_ms: int = 30_000  # librdkafka's retry window per attempt before we rebuild
    max_pending: int = 100_000  # unacknowledged events held; beyond this emit() raises
    retry_backoff_s: float = 0.5  # least time between two rebuilds / re-send rounds

    @classmethod
    def from_settings(cls, settings: BatonSettings, bootstrap: str | None = None) -> ProducerConfig:
        """`bootstrap` overrides the setting (an embedded broker started by the launcher)."""
        return cls(UsageTopic.from_settings(settings, bootstrap), settings.usage_delivery_timeout_ms,
                   settings.usage_max_pending)


class UsageProducer:
    def __init__(self, config: ProducerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pending: dict[str, UsageEvent] = {}  # every unacknowledged event, by request id
        self._in_flight: dict[str, int] = {}  # handed to librdkafka: request id -> producer generation
        self._to_send: dict[str, None] = {}  # ordered set: to (re-)produce from the background thread
        self._generation = 0
        self._reset_needed = False
        self._producer = self._new_producer()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="usage-producer", daemon=True)
        self.resets = 0  # how often the librdkafka producer was rebuilt (tests, metrics)

    def start(self) -> None:
        """Start the background thread, and make sure the topic exists on a thread of its own: an
        unreachable broker must delay neither the caller nor close()."""
        threading.Thread(target=self._ensure_topic, name="usage-topic", daemon=True).start()
        self._thread.start()

    def emit(self, event: UsageEvent) -> None:
        """Queue `event` for delivery. Raises UsageBacklogFullError rather than drop a billable event."""
        with self._lock:
            if event.request_id not in self._pending and len(self._pending) >= self.config.max_pending:
                raise UsageBacklogFullError(f"{len(self._pending)} usage events await the broker at "
                                            f"{self.config.topic.bootstrap}")
            self._pending[event.request_id] = event
            if event.request_id not in self._in_flight:
                self._produce_locked(event.request_id)

    @property
    def pending(self) -> int:
        """Events emitted but not yet acknowledged by a broker."""
        with self._lock:
            return len(self._pending)

    def pending_ids(self) -> set[str]:
        """The request ids of the events not yet acknowledged."""
        with self._lock:
            return set(self._pending)

    def flush(self, timeout_s: float) -> int:
        """Wait until every event is acknowledged or the timeout passes; returns how many are left."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.pending

    def close(self, timeout_s: float = 10.0) -> list[UsageEvent]:
        """Flush, stop the background thread, and return the events never acknowledged."""
        if self._thread.is_alive():
            self.flush(timeout_s)
            self._stop.set()
            self._thread.join()
        self._producer.flush(0)
        with self._lock:
            left = list(self._pending.values())
        if left:
            log.warning("%d usage events not acknowledged by the broker at close (their outbox rows stay "
                        "unsent for the next relay): %s", len(left), [e.request_id for e in left[:20]])
        return left

    def _new_producer(self) -> Producer:
        config = self.config.topic.producer_config(self.config.delivery_timeout_ms)
        # librdkafka's own log lines go through Python logging instead of raw stderr.
        return Producer({**config, "error_cb": self._on_error, "logger": log})

    def _produce_locked(self, request_id: str) -> None:
        event = self._pending[request_id]
        generation = self._generation
        try:
            self._producer.produce(self.config.topic.name, key=request_id.encode(), value=event.to_json(),
                                   on_delivery=lambda err, msg: self._on_delivery(generation, err, msg))
        except BufferError:  # librdkafka's local queue is full: the background thread retries
            self._to_send[request_id] = None
            return
        self._in_flight[request_id] = generation
        self._to_send.pop(request_id, None)

    def _on_delivery(self, generation: int, err: KafkaError | None, msg: Message) -> None:
        request_id = bytes(msg.key() or b"").decode()
        with self._lock:
            if self._in_flight.get(request_id) == generation:
                del self._in_flight[request_id]
            if err is None:
                self._pending.pop(request_id, None)
                return
            if request_id in self._pending and request_id not in self._in_flight:
                self._to_send[request_id] = None
            # Only a failure of the current producer means it may be wedged; failures of an old one
            # are the purge we did ourselves.
            if generation == self._generation:
                self._reset_needed = True
        log.debug("usage event %s not delivered (%s); will re-send", request_id, err)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            with self._lock:
                self._reset_needed = True
            log.error("usage producer fatal error, rebuilding: %s", err)
        else:
            log.info("usage producer: %s", err)

    def _ensure_topic(self) -> None:
        try:
            self.config.topic.ensure_exists(timeout_s=5)
        except BillingError as e:  # not fatal: events wait in memory until the broker is reachable
            log.warning("usage topic not ensured: %s", e)

    def _serve(self) -> None:
        last_round = 0.0
        while not self._stop.is_set():
            self._producer.poll(0.05)
            if time.monotonic() - last_round < self.config.retry_backoff_s:
                continue
            with self._lock:
                reset, resend = self._reset_needed, bool(self._to_send)
            if reset:
                self._rebuild()
            if reset or resend:
                last_round = time.monotonic()
                with self._lock:
                    for request_id in list(self._to_send):
                        if request_id in self._pending and request_id not in self._in_flight:
                            self._produce_locked(request_id)
                        else:
                            self._to_send.pop(request_id, None)

    def _rebuild(self) -> None:
        """Swap in a fresh librdkafka producer; what the old one still held is purged and re-sent."""
        with self._lock:
            old = self._producer
            self._generation += 1
            self._reset_needed = False
            self._producer = self._new_producer()
            self.resets += 1
        old.purge(in_queue=True, in_flight=True)
        old.flush(1.0)  # serves the purge callbacks: they put those events back into _to_send
        with self._lock:  # anything the old producer never reported back is re-sent too
            for request_id, generation in list(self._in_flight.items()):
                if generation < self._generation:
                    del self._in_flight[request_id]
            for request_id in self._pending:
                if request_id not in self._in_flight:
                    self._to_send[request_id] = None
        log.warning("usage producer rebuilt (%d); %d events to re-send", self.resets, len(self._to_send))
