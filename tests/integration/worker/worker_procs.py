"""Worker subprocesses for the integration tests: a test's view of one worker the cluster builder's way.

The command line is the builder's (`services.launcher.builder.worker_argv`), the process a
`SupervisedProcess` (its log, its process group, dying with the test process), readiness the builder's
(the worker's `BATON_WORKER_READY` line in this run's log) and a lost port race is retried as the builder
retries it (`retry_lost_port_race`). What a test adds: the gRPC stub and /metrics of the worker, its
signals (SIGTERM drain, SIGKILL of its whole group), and starting several workers before waiting for them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc

from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from scheduler.types import WorkerRole
from services.common.errors import InfraStartError
from services.launcher.builder import WORKER_READY, worker_argv
from services.launcher.fleet import WorkerPlan
from services.launcher.process import SupervisedProcess, free_port, lost_port_race, retry_lost_port_race

ROOT = Path(__file__).resolve().parents[3]


class WorkerExited(RuntimeError):
    """The worker process exited (or was stopped) before it was serving; the message carries its log's tail."""


class WorkerProcess:
    """One `python -m services.worker` subprocess. Its stdout/stderr go to `log_path` (appended per run)."""

    def __init__(self, name: str, role: str, model_dir: Path, log_dir: Path, *extra: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.plan = WorkerPlan(name, WorkerRole(role), ("--model", str(model_dir), "--torch-threads", "1", *extra),
                               worker_id=True)
        self._process: SupervisedProcess | None = None
        self._channel: grpc.Channel | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = worker_argv(self.plan, self.port, self.metrics_port)

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """This run's process (None before `start()`)."""
        return self._process.popen if self._process is not None else None

    def start(self) -> WorkerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # Its own process group (SupervisedProcess): `_kill` then takes a tensor-parallel worker's ranks with it.
        self._process = SupervisedProcess(self.name, self.args, self.log_path, env=env, cwd=ROOT,
                                          stop_timeout_s=30.0)
        self._process.start()
        return self

    def wait_serving(self, timeout_s: float = 120.0, port_attempts: int = 3) -> WorkerProcess:
        """Wait for this run's ready line, then check that the worker answering on the port is this one.
        Raises WorkerExited with the log tail if the process dies, TimeoutError if it is not ready in
        `timeout_s`. A worker that lost the race for a port `free_port` picked (another socket took it
        first: "address already in use") starts again on fresh ports, up to `port_attempts` times in all."""
        tries = itertools.count()

        def attempt() -> WorkerProcess:
            if next(tries):
                self._close_channel()
                self._pick_ports()
                self.start()
            return self._wait_once(timeout_s)

        try:
            return retry_lost_port_race(attempt, port_attempts)
        except InfraStartError as e:
            raise WorkerExited(("lost a port race: " if lost_port_race(e) else "") + str(e)) from e

    def _wait_once(self, timeout_s: float) -> WorkerProcess:
        assert self._process is not None, "start() first"
        give_up = time.monotonic() + timeout_s
        try:
            self._process.wait_ready(self._printed_ready, timeout_s)
        except InfraStartError as e:
            if time.monotonic() >= give_up:
                raise TimeoutError(f"worker {self.name} not SERVING after {timeout_s} s:\n{self.log_tail()}") from e
            raise
        self._check_it_is_this_worker()
        return self

    def _printed_ready(self) -> bool:
        """This run printed the worker's ready line. A run whose log says it lost a port is killed here: a
        tensor-parallel worker whose rank 0 lost its port can stay up, its other ranks waiting on the group,
        and `wait_ready` then reports the exit instead of waiting out the timeout."""
        assert self._process is not None
        log = self._process.log_of_this_run()
        if lost_port_race(log):
            self._kill()
        return WORKER_READY in log

    def _check_it_is_this_worker(self) -> None:
        """Another test worker that bound our picked port first answers on it too (gRPC binds with
        SO_REUSEPORT; seen in a full run: a slow TP=3 prefill worker's port taken by a TP=1 worker started
        after it, whose replies the prefill tests then read): that is a lost port race, not readiness."""
        serving = self.status().worker_id
        if serving != self.name:
            self._kill()
            raise InfraStartError(f"worker {self.name}: {serving} serves {self.address} (address already in use)")

    def _kill(self) -> None:
        proc = self.proc
        assert proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    def status(self) -> pb.WorkerStatus:
        return self.stub.GetStatus(pb.StatusRequest(), timeout=10.0)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def log_tail(self, n: int = 60) -> str:
        return self._process.log_tail(n) if self._process is not None else "(no log)"

    def signal(self, sig: int) -> None:
        proc = self.proc
        assert proc is not None
        proc.send_signal(sig)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def request_stop(self) -> None:
        """SIGTERM (graceful drain) once, without waiting; `stop()` then waits for the exit."""
        self._close_channel()
        if self._process is not None:
            self._process.request_stop()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL if it lingers; returns the exit code."""
        self._close_channel()
        return self._process.stop(timeout_s) if self._process is not None else None


def wait_all_serving(workers: list[WorkerProcess], timeout_s: float) -> None:
    """Wait for workers started together, under one deadline for the group: they load at the same time,
    so on a 2-core host the first one's wait pays for all of them (8 processes of the default model took
    over 180 s on CI, where the first PP worker came up just after a per-worker 180 s ran out)."""
    give_up = time.monotonic() + timeout_s
    for worker in workers:
        worker.wait_serving(max(give_up - time.monotonic(), 5.0))


def stop_workers(workers: list[WorkerProcess]) -> None:
    """Stop workers together at the end of their tests: all drain at once (nothing is in flight by then),
    so the wait is the slowest one's exit, not the sum of them (~1 s each on a loaded 2-core host)."""
    for worker in workers:
        worker.request_stop()
    for worker in workers:
        worker.stop()
