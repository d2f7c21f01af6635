"""Worker subprocesses for the integration tests: free ports, health-gated start, logs to a file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.launcher.process import free_port, lost_port_race

ROOT = Path(__file__).resolve().parents[3]


class WorkerExited(RuntimeError):
    """The worker process exited before it was serving; the message carries its log's tail."""


class WorkerProcess:
    """One `python -m services.worker` subprocess. Its stdout/stderr go to `log_path`."""

    def __init__(self, name: str, role: str, model_dir: Path, log_dir: Path, *extra: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._command = ("--role", role, "--model", str(model_dir), "--worker-id", name, "--torch-threads", "1",
                         *extra)
        self._pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop_requested = False  # a second SIGTERM is not sent: the drain is already under way
        self._channel: grpc.Channel | None = None

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "services.worker", *self._command,
                     "--port", str(self.port), "--metrics-port", str(self.metrics_port)]

    def start(self) -> WorkerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._stop_requested = False
        with open(self.log_path, "wb") as log:
            # Its own process group: `_kill` then takes a tensor-parallel worker's rank processes with it.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                         start_new_session=True)
        return self

    def wait_serving(self, timeout_s: float = 120.0, port_attempts: int = 3) -> WorkerProcess:
        """Poll gRPC health until SERVING; raise with the log tail if the process dies or it times out.
        A worker that lost the race for a port `free_port` picked (another socket took it before the
        worker bound it: "address already in use") starts again on fresh ports, up to `port_attempts`
        times in all."""
        for attempt in range(port_attempts):
            try:
                return self._wait_serving(timeout_s)
            except WorkerExited as e:
                if not lost_port_race(e) or attempt == port_attempts - 1:
                    raise
                self._close_channel()
                self._pick_ports()
                self.start()
        raise ValueError(f"port_attempts must be >= 1, got {port_attempts}")

    def _wait_serving(self, timeout_s: float) -> WorkerProcess:
        give_up = time.monotonic() + timeout_s
        stub = health_pb2_grpc.HealthStub(self.channel)
        while time.monotonic() < give_up:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise WorkerExited(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="baton.v1.Worker"), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self._check_it_is_this_worker()
                    return self
            except grpc.RpcError:
                if lost_port_race(self.log_tail()):
                    # A tensor-parallel worker whose rank 0 lost its port can stay up, its other ranks
                    # waiting on the group: stop it rather than wait out the timeout.
                    self._kill()
                    raise WorkerExited(f"worker {self.name} lost a port race:\n{self.log_tail()}") from None
            time.sleep(0.2)
        raise TimeoutError(f"worker {self.name} not SERVING after {timeout_s} s:\n{self.log_tail()}")

    def _check_it_is_this_worker(self) -> None:
        """Another test worker that bound our picked port first answers health on it too (seen in a full
        run: a slow TP=3 prefill worker's port taken by a TP=1 worker started after it, whose replies the
        prefill tests then read): that is a lost port race, not readiness."""
        serving = self.status().worker_id
        if serving != self.name:
            self._kill()
            raise WorkerExited(f"worker {self.name} lost a port race: {serving} serves {self.address}\n"
                               "address already in use")

    def _kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

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
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def request_stop(self) -> None:
        """SIGTERM (graceful drain) once, without waiting; `stop()` then waits for the exit."""
        self._close_channel()
        if self.proc is not None and self.proc.poll() is None and not self._stop_requested:
            self._stop_requested = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL if it lingers; returns the exit code."""
        self.request_stop()
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def stop_workers(workers: list[WorkerProcess]) -> None:
    """Stop workers together at the end of their tests: all drain at once (nothing is in flight by then),
    so the wait is the slowest one's exit, not the sum of them (~1 s each on a loaded 2-core host)."""
    for worker in workers:
        worker.request_stop()
    for worker in workers:
        worker.stop()
