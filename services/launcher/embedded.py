"""`EmbeddedService`: the shape shared by embedded Postgres, Redis and the Kafka-protocol broker.

A subclass says how to build its command line for a port and how to probe readiness; this base picks
a free port once (kept across restarts, so clients can reconnect to the same address), starts the
supervised child, waits for readiness and retries when another process grabbed the port in between.
"""

from __future__ import annotations

import shutil
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from types import TracebackType

from services.common.errors import InfraStartError
from services.launcher.process import SupervisedProcess, free_port, lost_port_race

_START_ATTEMPTS = 3


class EmbeddedService(ABC):
    """Start/stop one local service. Not thread-safe: one owner starts and stops it."""

    name: str = "service"

    def __init__(self, port: int | None, work_dir: Path | None, start_timeout_s: float) -> None:
        self._fixed_port = port
        self._port: int | None = port
        self._start_timeout_s = start_timeout_s
        self._owns_work_dir = work_dir is None
        self._work_dir = work_dir
        self._process: SupervisedProcess | None = None

    @property
    def work_dir(self) -> Path:
        """Logs (and Postgres's data) live here; a temp dir is made on first use when none was given."""
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix=f"baton-{self.name}-"))
        return self._work_dir

    @property
    def port(self) -> int:
        if self._port is None:
            raise InfraStartError(f"{self.name} has not been started")
        return self._port

    @property
    @abstractmethod
    def url(self) -> str:
        """The client address of the running service."""

    @abstractmethod
    def _make_process(self, port: int) -> SupervisedProcess:
        """The supervised child that serves on `port` (binaries are checked here, clearly)."""

    @abstractmethod
    def _probe(self) -> bool:
        """True once the service answers a real request (not just an open TCP port)."""

    def _prepare(self) -> None:  # noqa: B027 - an optional hook, not an abstract step
        """One-time set-up before the first start (e.g. initdb). Default: nothing."""

    def _after_ready(self) -> None:  # noqa: B027 - an optional hook, not an abstract step
        """Set-up that needs the running service (e.g. create a database). Default: nothing."""

    def start(self) -> None:
        """Start and wait until ready; raises `InfraStartError` with the log tail on failure."""
        if self._process is not None and self._process.alive():
            return
        self._prepare()
        for attempt in range(_START_ATTEMPTS):
            if self._port is None or (attempt > 0 and self._fixed_port is None):
                self._port = free_port()
            process = self._process = self._make_process(self._port)
            process.start()
            try:
                process.wait_ready(self._ready, self._start_timeout_s)
                break
            except InfraStartError as e:
                if not lost_port_race(e) or self._fixed_port is not None or attempt == _START_ATTEMPTS - 1:
                    raise
        self._after_ready()

    def _ready(self) -> bool:
        # Our child must own the listening socket: a probe alone would be answered by any other server
        # already on the port while our child dies of EADDRINUSE.
        assert self._process is not None and self._port is not None
        return self._process.listens_on(self._port) and self._probe()

    def stop(self) -> None:
        """Graceful stop then kill. The port is kept: a later start() serves on the same address."""
        if self._process is not None:
            self._process.stop()

    def kill(self) -> None:
        """SIGKILL, no shutdown (crash tests)."""
        if self._process is not None:
            self._process.kill()

    def close(self) -> None:
        """Stop and remove the work directory if this object created it."""
        self.stop()
        if self._owns_work_dir and self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def log_tail(self, lines: int = 40) -> str:
        return self._process.log_tail(lines) if self._process else "(not started)"

    def __enter__(self) -> EmbeddedService:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
