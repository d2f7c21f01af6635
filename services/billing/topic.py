"""The usage topic: its Kafka client settings and idempotent creation.

`UsageTopic` is the frozen config both ends share; `extra_*` (from `BATON_KAFKA_*_CONFIG`) override
the defaults here, which is how tests shorten session timeouts and production adds SASL/TLS.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from services.common.errors import BillingError
from services.common.settings import BatonSettings, KafkaConfigValue

KafkaConfig = dict[str, KafkaConfigValue]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsageTopic:
    bootstrap: str
    name: str = "baton.usage"
    partitions: int = 4
    extra_producer: KafkaConfig = field(default_factory=dict)
    extra_consumer: KafkaConfig = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: BatonSettings, bootstrap: str | None = None) -> UsageTopic:
        resolved = bootstrap or settings.kafka_bootstrap
        if not resolved:
            raise BillingError("no Kafka: set BATON_KAFKA_BOOTSTRAP (or let `baton serve` embed a broker)")
        return cls(resolved, settings.usage_topic, extra_producer=dict(settings.kafka_producer_config),
                   extra_consumer=dict(settings.kafka_consumer_config))

    def producer_config(self, delivery_timeout_ms: int) -> KafkaConfig:
        return {
            "bootstrap.servers": self.bootstrap,
            "enable.idempotence": True,  # no broker-side duplicates from librdkafka's own retries
            "acks": "all",
            "message.timeout.ms": delivery_timeout_ms,
            "linger.ms": 5,
            "reconnect.backoff.max.ms": 1000,
            **self.extra_producer,
        }

    def consumer_config(self, group_id: str) -> KafkaConfig:
        return {
            "bootstrap.servers": self.bootstrap,
            "group.id": group_id,
            "enable.auto.commit": False,  # offsets are committed only after Postgres commits
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",  # a new group (or a wiped broker) reads everything
            "isolation.level": "read_committed",
            # Notice a recreated topic quickly (librdkafka's default is 5 minutes).
            "topic.metadata.refresh.interval.ms": 5000,
            **self.extra_consumer,
        }

    def ensure_exists(self, timeout_s: float = 10.0) -> None:
        """Create the topic unless it exists (racing creators are fine)."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap, "logger": log,
                                **_client_security(self.extra_consumer)}
        admin = AdminClient(conf)
        futures = admin.create_topics([NewTopic(self.name, num_partitions=self.partitions)],
                                      operation_timeout=timeout_s, request_timeout=timeout_s)
        try:
            futures[self.name].result(timeout=timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise BillingError(f"cannot create topic {self.name!r}: {self.bootstrap} did not answer "
                               f"within {timeout_s}s") from e
        except KafkaException as e:
            if e.args and isinstance(e.args[0], KafkaError) and \
                    e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return
            raise BillingError(f"cannot create topic {self.name!r} on {self.bootstrap}: {e}") from e


def _client_security(extra: KafkaConfig) -> KafkaConfig:
    # The admin client needs the same security settings as the consumer, not its group settings.
    return {k: v for k, v in extra.items() if k.startswith(("security.", "sasl.", "ssl."))}
