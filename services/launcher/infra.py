"""`EmbeddedInfra`: Postgres, Redis and the Kafka-protocol broker for one local Baton.

Each service runs embedded unless its URL is given (`BATON_DATABASE_URL`, `BATON_REDIS_URL`,
`BATON_KAFKA_BOOTSTRAP`, read by main into `InfraConfig`): given URLs are used as they are and nothing
is started for them. The embedded broker keeps its data in an embedded S3-compatible store
(`kafka-store`, under `<work_dir>/kafka-store`), so a broker restart loses no acknowledged message.
Start order is Postgres, Redis, broker store, broker; stop is the reverse. A failure part-way stops what
was already started before raising.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from services.common.settings import BatonSettings
from services.launcher.embedded import EmbeddedService
from services.launcher.object_store import EmbeddedObjectStore, ObjectStoreConfig
from services.launcher.postgres import EmbeddedPostgres, PostgresConfig
from services.launcher.redis_server import EmbeddedRedis, RedisConfig
from services.launcher.tansu import EmbeddedKafka, KafkaBrokerConfig


@dataclass(frozen=True)
class InfraConfig:
    database_url: str | None = None
    redis_url: str | None = None
    kafka_bootstrap: str | None = None
    work_dir: Path | None = None  # None: temp dirs (data gone at stop); set: Postgres and broker data persist

    @classmethod
    def from_settings(cls, settings: BatonSettings, work_dir: Path | None = None) -> InfraConfig:
        return cls(settings.database_url, settings.redis_url, settings.kafka_bootstrap, work_dir)


@dataclass(frozen=True)
class InfraEndpoints:
    """Where the services are, embedded or external."""

    database_url: str
    redis_url: str
    kafka_bootstrap: str

    def env(self) -> dict[str, str]:
        """The settings that point a child (gateway, billing) at these services."""
        return {"BATON_DATABASE_URL": self.database_url, "BATON_REDIS_URL": self.redis_url,
                "BATON_KAFKA_BOOTSTRAP": self.kafka_bootstrap}


class EmbeddedInfra:
    def __init__(self, config: InfraConfig) -> None:
        self.config = config
        def sub(name: str) -> Path | None:
            return config.work_dir / name if config.work_dir else None

        self.postgres = None if config.database_url else EmbeddedPostgres(PostgresConfig(work_dir=sub("pg")))
        self.redis = None if config.redis_url else EmbeddedRedis(RedisConfig(work_dir=sub("redis")))
        self.kafka_store = (None if config.kafka_bootstrap
                            else EmbeddedObjectStore(ObjectStoreConfig(work_dir=sub("kafka-store"))))
        self.kafka = (None if self.kafka_store is None
                      else EmbeddedKafka(KafkaBrokerConfig(work_dir=sub("kafka")), self.kafka_store))
        self._endpoints: InfraEndpoints | None = None

    def _embedded(self) -> list[EmbeddedService]:
        return [s for s in (self.postgres, self.redis, self.kafka_store, self.kafka) if s is not None]

    def embedded_by_name(self) -> dict[str, EmbeddedService]:
        """The services started here (not the external ones), for the supervisor to restart."""
        return {s.name: s for s in self._embedded()}

    def start(self) -> InfraEndpoints:
        started: list[EmbeddedService] = []
        try:
            for service in self._embedded():
                service.start()
                started.append(service)
        except BaseException:
            for service in reversed(started):
                service.close()
            raise
        self._endpoints = InfraEndpoints(
            database_url=self.postgres.url if self.postgres else str(self.config.database_url),
            redis_url=self.redis.url if self.redis else str(self.config.redis_url),
            kafka_bootstrap=self.kafka.url if self.kafka else str(self.config.kafka_bootstrap))
        return self._endpoints

    @property
    def endpoints(self) -> InfraEndpoints:
        assert self._endpoints is not None, "EmbeddedInfra.start() first"
        return self._endpoints

    def stop(self) -> None:
        for service in reversed(self._embedded()):
            service.close()

    def __enter__(self) -> InfraEndpoints:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
