"""`--processes N`: N gateway processes sharing one port, so one event loop is no longer the ceiling.

Why: every request and every streamed token crosses the gateway's single event loop (~120-140 us of its
CPU per token on the benchmark hosts, docs/benchmarks.md), so one process streams at most ~7-8k tokens/s
whatever the GPUs behind it could do. The processes here split that work the way vLLM's API-server count
or several Kubernetes replicas do, on one host.

How:
- Each replica binds its own listening socket with SO_REUSEPORT on the same host:port, and the kernel
  spreads new connections over them (by a hash of the connection); the internal gRPC API port is shared
  the same way (gRPC sets SO_REUSEPORT itself). A stream, its disconnect and its keep-alives stay on the
  connection, so on one replica.
- Everything a replica shares with the others already lives outside it: rate limits (Redis), keys,
  budgets and conversations (Postgres), the usage spool (one file, locked per access), stream resume
  and cancel across replicas (the Redis relay, stream_relay.py; without Redis a resume that lands on
  another replica is a 404, as between Kubernetes replicas).
- `/metrics` answers from whichever replica takes the scrape, so the replicas keep their metrics in
  prometheus_client's multiprocess files (a directory this supervisor owns) and each renders the sum.
- This process only supervises: it starts the replicas, restarts one that dies (its streams are lost
  with it; the others keep serving), forwards SIGTERM/SIGINT so every replica drains, and exits when they
  have. A replica that exits with the configuration-error code, or keeps dying, stops the whole gateway.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from prometheus_client import multiprocess

from services.common.lifetime import die_with_parent

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own name for it
REPLICA_ENV = "BATON_GATEWAY_REPLICA"
CONFIG_ERROR_EXIT = 2  # what the gateway's main returns on bad settings: restarting cannot help


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other replicas can bind too (SO_REUSEPORT)."""
    if port == 0:
        raise ValueError("replicas need a fixed port: with port 0 each would listen on a different one")
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    return sock


@dataclass(frozen=True)
class RestartLimits:
    backoff_s: float = 0.5  # first delay before a dead replica is started again; doubles per death
    max_backoff_s: float = 10.0
    max_deaths: int = 5  # deaths within `window_s` that stop the gateway (a replica that cannot stay up)
    window_s: float = 60.0


@dataclass
class _Replica:
    index: int
    process: subprocess.Popen[bytes]
    deaths: list[float] = field(default_factory=list)  # monotonic times this slot's process died
    restart_at: float | None = None  # dead, to be started again then


Spawn = Callable[[int, dict[str, str]], "subprocess.Popen[bytes]"]


class ReplicaSupervisor:
    """Runs `count` replicas, each `spawn(index, env)`; `run()` returns the gateway's exit code."""

    def __init__(self, count: int, spawn: Spawn, drain_timeout_s: float,
                 limits: RestartLimits = RestartLimits(), poll_s: float = 0.1, drain_slack_s: float = 10.0) -> None:
        """`drain_timeout_s`: each replica's own drain; past it plus `drain_slack_s` a replica is killed."""
        if count < 2:
            raise ValueError(f"a supervisor runs 2 or more replicas, got {count}")
        self.count = count
        self.spawn = spawn
        self.drain_timeout_s = drain_timeout_s
        self.limits = limits
        self.poll_s = poll_s
        self.drain_slack_s = drain_slack_s
        self.stopping = False
        self.exit_code = 0
        self.metrics_dir = tempfile.mkdtemp(prefix="baton-gateway-metrics-")
        self.replicas: list[_Replica] = []

    def _env(self, index: int) -> dict[str, str]:
        return {**os.environ, METRICS_DIR_ENV: self.metrics_dir, REPLICA_ENV: str(index)}

    def _start(self, index: int) -> subprocess.Popen[bytes]:
        process = self.spawn(index, self._env(index))
        log.info("gateway replica %d started (pid %d)", index, process.pid)
        return process

    def stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Drain every replica (a signal handler too)."""
        if not self.stopping:
            log.info("gateway: stopping %d replicas (signal %d)", self.count, signum)
        self.stopping = True

    def run(self) -> int:
        try:
            self.replicas = [_Replica(i, self._start(i)) for i in range(self.count)]
            while not self.stopping:
                self._tend(time.monotonic())
                time.sleep(self.poll_s)
            self._drain()
        finally:
            self._kill_all()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return self.exit_code

    def _tend(self, now: float) -> None:
        """Notice deaths, restart what is due, give up on a replica that cannot stay up."""
        for replica in self.replicas:
            if replica.restart_at is not None:
                if now >= replica.restart_at:
                    replica.process, replica.restart_at = self._start(replica.index), None
                continue
            code = replica.process.poll()
            if code is None:
                continue
            self._forget_metrics(replica.process.pid)
            replica.deaths = [t for t in replica.deaths if now - t < self.limits.window_s] + [now]
            if code == CONFIG_ERROR_EXIT or len(replica.deaths) >= self.limits.max_deaths:
                why = "a configuration error" if code == CONFIG_ERROR_EXIT else \
                    f"{len(replica.deaths)} deaths in {self.limits.window_s:.0f} s"
                log.error("gateway replica %d exited with code %d (%s): stopping the gateway", replica.index,
                          code, why)
                self.exit_code = code if code > 0 else 1  # killed by a signal: a plain failure
                self.stopping = True
                return
            delay = min(self.limits.backoff_s * 2 ** (len(replica.deaths) - 1), self.limits.max_backoff_s)
            log.error("gateway replica %d (pid %d) exited with code %d; restarting it in %.1f s (its open "
                      "streams are lost, the other replicas serve on)", replica.index, replica.process.pid,
                      code, delay)
            replica.restart_at = now + delay

    def _drain(self) -> None:
        """SIGTERM to every live replica, then wait for their drains (each bounded by its own timeout)."""
        live = [r.process for r in self.replicas if r.restart_at is None and r.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s + self.drain_slack_s
        for process in live:
            try:
                code = process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.error("gateway replica pid %d did not drain in time: killing it", process.pid)
                code = 1
            if code not in (0, -signal.SIGTERM) and self.exit_code == 0:
                self.exit_code = 1

    def _kill_all(self) -> None:
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait()

    def _forget_metrics(self, pid: int) -> None:
        """A dead replica's live gauges (in-flight generations) leave the sum; its counters stay."""
        multiprocess.mark_process_dead(pid, self.metrics_dir)


def run_replicas(count: int, child_argv: Sequence[str], drain_timeout_s: float) -> int:
    """The gateway as `count` replicas of `child_argv` (each gets `--replica <i>`), until SIGTERM/SIGINT."""
    parent = os.getpid()
    supervisor = ReplicaSupervisor(
        count, lambda index, env: subprocess.Popen([*child_argv, "--replica", str(index)], env=env,
                                                   preexec_fn=die_with_parent(parent)),
        drain_timeout_s)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    return supervisor.run()
