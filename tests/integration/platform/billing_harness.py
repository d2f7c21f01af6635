"""Helpers for the billing tests: the consumer as a real subprocess, and consumer-group lag."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from services.billing.topic import UsageTopic

REPO = Path(__file__).resolve().parents[3]

# Kafka client settings for tests: fast group membership, so a killed consumer's
# partitions move to its successor in about two seconds.
KAFKA_TEST_CONSUMER_CONFIG = {"session.timeout.ms": 2000, "heartbeat.interval.ms": 300,
                              "max.poll.interval.ms": 10000}


class ConsumerProcess:
    """`python -m services.billing` as a real child process, configured only through BATON_* env."""

    def __init__(self, database_url: str, topic: UsageTopic, group: str, log_path: Path) -> None:
        self.env = dict(os.environ, BATON_DATABASE_URL=database_url, BATON_KAFKA_BOOTSTRAP=topic.bootstrap,
                        BATON_USAGE_TOPIC=topic.name, BATON_BILLING_GROUP_ID=group,
                        BATON_BILLING_BATCH_SIZE="20",
                        BATON_KAFKA_CONSUMER_CONFIG=json.dumps(KAFKA_TEST_CONSUMER_CONFIG))
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.billing"], cwd=REPO, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """SIGKILL: no shutdown at all, as in a crash or an OOM kill."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(timeout=20)

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])


def uncommitted_messages(topic: UsageTopic, group: str) -> int:
    """How many messages of the topic lie beyond `group`'s committed offsets, counted by reading them.

    Not from watermarks: Tansu 0.6 reports a partition's high watermark as the base offset of its last
    record batch + 1, so watermark arithmetic undercounts whenever the producer batches. Reading is
    exact. The probe assigns partitions itself: it never joins (or disturbs) the group.
    """
    probe = Consumer({"bootstrap.servers": topic.bootstrap, "group.id": group, "enable.auto.commit": False,
                      "enable.partition.eof": True})
    try:
        partitions = probe.list_topics(topic.name, timeout=5).topics[topic.name].partitions
        committed = probe.committed([TopicPartition(topic.name, p) for p in partitions], timeout=5)
        probe.assign([TopicPartition(topic.name, tp.partition,
                                     tp.offset if tp.offset >= 0 else OFFSET_BEGINNING) for tp in committed])
        return _count_to_end(probe, len(committed))
    finally:
        probe.close()


def _count_to_end(probe: Consumer, partitions: int) -> int:
    count, at_end = 0, set()
    deadline = time.monotonic() + 10
    while len(at_end) < partitions and time.monotonic() < deadline:
        for msg in probe.consume(500, 0.2):
            err = msg.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                at_end.add(msg.partition())
            elif err is None:
                count += 1
                at_end.discard(msg.partition())
    assert len(at_end) == partitions, "the probe could not read every partition to its end"
    return count


def wait_for(condition: Callable[[], bool], what: str, log: Callable[[], str], timeout_s: float = 40) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}; consumer log:\n{log()}"
        time.sleep(0.1)
