"""`Supervisor`: start a cluster's processes in order, watch them, stop them in reverse order.

Each child is a `SupervisedProcess` (process.py): its own session and process group (a terminal's
Ctrl-C reaches only the supervisor, which then stops children in order) and the parent-death signal
(SIGKILL when the supervisor dies, even by SIGKILL). A child is started only after the previous one is
ready (`ReadyCheck`: a log line, a listening port, an HTTP 200). Stopping sends each child its
graceful signal, waits its `stop_timeout_s`, SIGKILLs it, then SIGKILLs what is left of its process
group (grandchildren a child failed to reap).

Synchronous and main-thread only on purpose: the parent-death signal fires when the *thread* that
forked a child exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import InfraStartError
from services.launcher.process import SupervisedProcess

log = logging.getLogger(__name__)
ReadyCheck = Callable[[SupervisedProcess], bool]


def log_line(marker: str) -> ReadyCheck:
    """Ready once the child's log contains `marker` (e.g. the worker's `BATON_WORKER_READY`)."""
    def probe(process: SupervisedProcess) -> bool:
        try:
            return marker in process.log_path.read_text(errors="replace")
        except OSError:
            return False
    return probe


def listening(port: int) -> ReadyCheck:
    """Ready once the child itself listens on `port` (not merely: something answers there)."""
    return lambda process: process.listens_on(port)


def http_ok(url: str) -> ReadyCheck:
    def probe(process: SupervisedProcess) -> bool:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own local URL
            return int(response.status) == 200
    return probe


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    ready: ReadyCheck
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0
    stop_signal: signal.Signals = signal.SIGTERM


class Supervisor:
    """Not thread-safe; one owner (the main thread) starts, watches and stops."""

    def __init__(self, log_dir: Path, cwd: Path | None = None) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.children: list[tuple[ChildSpec, SupervisedProcess]] = []

    def start(self, spec: ChildSpec) -> SupervisedProcess:
        """Start `spec` and wait until ready; on failure raise InfraStartError with its log tail."""
        process = SupervisedProcess(spec.name, spec.argv, self.log_dir / f"{spec.name}.log",
                                    env={**os.environ, **spec.env}, cwd=self.cwd,
                                    stop_signal=spec.stop_signal, stop_timeout_s=spec.stop_timeout_s)
        process.start()
        self.children.append((spec, process))
        started = time.monotonic()
        process.wait_ready(lambda: spec.ready(process), spec.ready_timeout_s)
        log.info("%s ready in %.1fs (pid %s)", spec.name, time.monotonic() - started, process.pid)
        return process

    def run_once(self, name: str, argv: list[str], timeout_s: float) -> None:
        """Run a set-up step to completion (not supervised afterwards); a failure raises with its log."""
        log_path = self.log_dir / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            try:
                code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      cwd=self.cwd, timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired as e:
                raise InfraStartError(f"{name} did not finish within {timeout_s:.0f}s; log {log_path}") from e
        if code != 0:
            raise InfraStartError(f"{name} failed (exit code {code}); log {log_path}:\n{self.log_tail(name)}")

    def dead_child(self) -> str | None:
        """The name of the first child that exited on its own, if any."""
        for spec, process in self.children:
            if not process.alive():
                return spec.name
        return None

    def watch(self, should_stop: Callable[[], bool], poll_s: float = 0.5) -> str | None:
        """Block until `should_stop()` or a child dies; returns the dead child's name (None: asked to stop)."""
        while not should_stop():
            dead = self.dead_child()
            if dead is not None:
                return dead
            time.sleep(poll_s)
        return None

    def stop_all(self) -> None:
        """Stop every child, the last started first (gateway before workers before infrastructure)."""
        while self.children:
            spec, process = self.children.pop()
            code = process.stop()
            if process.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)  # whatever the child left in its group
            log.info("%s stopped (exit code %s)", spec.name, code)

    def log_tail(self, name: str, lines: int = 30) -> str:
        for spec, process in self.children:
            if spec.name == name:
                return process.log_tail(lines)
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
