"""Cost-based prefill siting across the process edge: a real scheduler process (`goodput`), workers
registered over gRPC, and the gateway's RouterClient turning the answer into the worker's prefill
mode. A long prompt next to a busy decode batch goes to the prefill worker; a short one, and the
long one once the prefill worker is backlogged, stay on the decode worker, with the reason in the
Route answer. Then the operator's `set-role` turns the prefill worker into a decode worker.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import worker_pb2
from scheduler.types import SLO, RequestSummary, Tier
from services.gateway.completions.generation import GenerateTarget
from services.gateway.routing.router_client import RouterClient, RouteSource
from tests.support.scheduler_process import ROOT, SchedulerProcess

ADDRESSES = {"d": "127.0.0.1:7201", "p": "127.0.0.1:7202"}
ROLES = {"d": "decode", "p": "prefill"}


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[SchedulerProcess]:
    process = SchedulerProcess(tmp_path / "scheduler.log", "goodput", "--heartbeat-timeout-s", "60").start()
    yield process
    process.kill()


def _status(worker_id: str, role: str | None = None, **load: int) -> worker_pb2.WorkerStatus:
    return worker_pb2.WorkerStatus(worker_id=worker_id, role=role or ROLES[worker_id], model="m", free_blocks=4000,
                                   total_blocks=4000, block_size=16, max_num_seqs=64, **load)


def _register(scheduler: SchedulerProcess, worker_id: str, **load: int) -> None:
    request = pb.RegisterRequest(worker_id=worker_id, address=ADDRESSES[worker_id], status=_status(worker_id, **load))
    scheduler.stub.Register(request, timeout=30, wait_for_ready=True)


def _summary(request_id: str, prompt: int) -> RequestSummary:
    return RequestSummary(request_id, prompt, tuple(range(1, prompt // 16 + 1)), Tier.ENTERPRISE,
                          SLO(ttft_ms=5000, tpot_ms=100), max_tokens=64)


async def test_the_prefill_site_reaches_the_worker_as_its_prefill_mode(scheduler: SchedulerProcess) -> None:
    _register(scheduler, "d", running_seqs=8)
    _register(scheduler, "p")
    client = RouterClient(scheduler.address)
    try:
        long = await client.route(_summary("long", 2048))
        short = await client.route(_summary("short", 20))
    finally:
        await client.close()
    for decision in (long, short):
        assert decision.source is RouteSource.SCHEDULER and decision.decode_address == ADDRESSES["d"]
    remote = GenerateTarget(long.decode_address, long.prefill_address, local_prefill_decided=True)
    local = GenerateTarget(short.decode_address, short.prefill_address, local_prefill_decided=True)
    assert (remote.prefill_address, remote.prefill_mode) == (ADDRESSES["p"], worker_pb2.PREFILL_MODE_REMOTE)
    assert (local.prefill_address, local.prefill_mode) == (None, worker_pb2.PREFILL_MODE_LOCAL)
    scheduler.finished("long")
    scheduler.finished("short")

    # The prefill worker reports a deep queue: the same long prompt now stays local.
    busy = pb.HeartbeatRequest(status=_status("p", inflight_prefill_tokens=400_000, queue_depth=100))
    assert scheduler.stub.Heartbeat(busy, timeout=5).known
    answer = scheduler.route(_summary("long-again", 2048))
    assert (answer.prefill_worker, answer.prefill_reason) == ("", "prefill_fleet_busy")


def test_baton_scheduler_set_role_drains_and_switches_a_worker(scheduler: SchedulerProcess) -> None:
    _register(scheduler, "d")
    _register(scheduler, "p")
    command = [sys.executable, "-m", "services.cli", "scheduler", "set-role", "p", "decode", "--json",
               "--scheduler", scheduler.address]
    asked = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0, asked.stderr
    assert '"state": "switching"' in asked.stdout  # idle already: told at its next heartbeat
    reply = scheduler.stub.Heartbeat(pb.HeartbeatRequest(status=_status("p")), timeout=5)
    assert reply.switch_to_role == "decode"
    scheduler.stub.Heartbeat(pb.HeartbeatRequest(status=_status("p", role="decode")), timeout=5)
    listed = subprocess.run([*command[:4], "workers", "--json", "--scheduler", scheduler.address], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert '"worker_id": "p", "role": "decode"' in listed.stdout, listed.stdout + listed.stderr
