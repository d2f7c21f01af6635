"""A real scheduler process (`python -m scheduler.adapters`) for integration tests, and blocking helpers
to ask it what it knows (ListWorkers) and where it routes (Route, then Finished)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler.types import RequestSummary
from services.gateway.routing.convert import summary_to_proto

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SchedulerProcess:
    """One scheduler subprocess on a fixed port, so that a restart keeps the address workers know."""

    def __init__(self, log_path: Path, policy: str, *extra: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path  # a file, not a pipe: nobody reads a pipe, so it could fill and block
        self.args = [sys.executable, "-m", "scheduler.adapters", "--host", "127.0.0.1", "--port", str(self.port),
                     "--policy", policy, "--metrics-port", str(self.metrics_port), "--log-level", "WARNING", *extra]
        self.proc: subprocess.Popen[bytes] | None = None
        self._channel: grpc.Channel | None = None

    def start(self) -> SchedulerProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; everything it learnt is gone."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return pb_grpc.SchedulerStub(self._channel)

    def live_workers(self) -> dict[str, str]:
        """worker id -> the address the scheduler routes to, for every live worker."""
        reply = self.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
        return {w.status.worker_id: w.address for w in reply.workers}

    def wait_workers(self, worker_ids: set[str], timeout_s: float = 60.0) -> None:
        """Until every one of `worker_ids` registered and is live (the process may still be starting)."""
        give_up = time.monotonic() + timeout_s
        seen: set[str] = set()
        while time.monotonic() < give_up:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            try:
                seen = set(self.live_workers())
            except grpc.RpcError:
                seen = set()
            if worker_ids <= seen:
                return
            time.sleep(0.1)
        raise AssertionError(f"scheduler sees {sorted(seen)} after {timeout_s} s, not {sorted(worker_ids)}")

    def decide(self, summary: RequestSummary) -> tuple[pb.RouteResponse, bool]:
        """(the final decision for `summary`, whether the scheduler queued it first). The caller owes
        `finished(request_id)` once the request ends, as the gateway does."""
        answers = list(self.stub.Route(summary_to_proto(summary), timeout=60))
        return answers[-1], answers[0].kind == pb.RouteResponse.KIND_QUEUE

    def finished(self, request_id: str) -> None:
        self.stub.Finished(pb.FinishedRequest(request_id=request_id), timeout=5)

    def route(self, summary: RequestSummary) -> pb.RouteResponse:
        """The final decision for `summary`, then `Finished` for it: a probe leaves no load behind."""
        try:
            return self.decide(summary)[0]
        finally:
            self.finished(summary.request_id)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"
