"""The embedded broker's storage: memory vs the on-disk store, as `baton serve` starts them.

    python -m lab.micro.bench_broker_storage [--messages 200] [--burst 2000] [--out results/broker.json]

For each storage (`memory`: Tansu's `memory://`; `disk`: `s3://` on the local `kafka-store`, fsync'ed
objects) it reports the start-up time (store + broker ready), the latency of one acknowledged
produce at a time (acks=all, the usage topic's producer settings; p50/p95 over `--messages`) and the
rate of a burst of `--burst` messages sent without waiting. Messages are 300 bytes, like a usage event.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from confluent_kafka import Producer

from services.billing.topic import UsageTopic
from services.launcher.object_store import EmbeddedObjectStore
from services.launcher.tansu import EmbeddedKafka

EVENT = b"x" * 300


@dataclass(frozen=True)
class StorageFigures:
    storage: str
    start_s: float
    acked_p50_ms: float
    acked_p95_ms: float
    burst_msg_per_s: float


def _sequential_ms(producer: Producer, topic: str, count: int) -> list[float]:
    latencies = []
    for i in range(count):
        start = time.perf_counter()
        producer.produce(topic, key=str(i).encode(), value=EVENT)
        producer.flush(10)
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies


def _burst_rate(producer: Producer, topic: str, count: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        producer.produce(topic, key=str(i).encode(), value=EVENT)
        producer.poll(0)
    producer.flush(60)
    return count / (time.perf_counter() - start)


def measure(storage: str, messages: int, burst: int) -> StorageFigures:
    started = time.monotonic()
    store = EmbeddedObjectStore() if storage == "disk" else None
    if store is not None:
        store.start()
    broker = EmbeddedKafka(store=store)
    try:
        broker.start()
        start_s = time.monotonic() - started
        topic = UsageTopic(broker.url)
        topic.ensure_exists()
        producer = Producer({**topic.producer_config(delivery_timeout_ms=20_000), "log_level": 0})
        _sequential_ms(producer, topic.name, 5)  # warm-up: metadata, producer id
        latencies = _sequential_ms(producer, topic.name, messages)
        quantiles = statistics.quantiles(latencies, n=20)
        return StorageFigures(storage, round(start_s, 2), round(statistics.median(latencies), 1),
                              round(quantiles[18], 1), round(_burst_rate(producer, topic.name, burst)))
    finally:
        broker.close()
        if store is not None:
            store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    figures = [measure(storage, args.messages, args.burst) for storage in ("memory", "disk")]
    for f in figures:
        print(f"{f.storage:6s}  start {f.start_s:5.2f} s  acked produce p50 {f.acked_p50_ms:5.1f} ms  "
              f"p95 {f.acked_p95_ms:5.1f} ms  burst {f.burst_msg_per_s:8.0f} msg/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(f) for f in figures], indent=2))


if __name__ == "__main__":
    main()
