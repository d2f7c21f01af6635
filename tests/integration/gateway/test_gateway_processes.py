"""`BATON_GATEWAY_PROCESSES=2`: two gateway processes on one port in front of a real `both` worker
(services/gateway/replicas.py). Connections spread over both, every one streams, `/metrics` is the sum
over both, a killed replica is replaced while the other serves on, and a SIGTERM drains both and exits 0."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.launcher.process import SupervisedProcess, free_port
from services.launcher.supervisor import Supervisor
from tests.support.gateway_stack import MODEL, open_gateway_env, start_gateway, start_worker

ROOT = Path(__file__).resolve().parents[3]
REPLICA = "x-baton-gateway-replica"
_INFRA_VARS = ("BATON_DATABASE_URL", "BATON_REDIS_URL", "BATON_KAFKA_BOOTSTRAP")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[tuple[SupervisedProcess,
                                                                                                     str]]:
    supervisor = Supervisor(tmp_path_factory.mktemp("gateway-processes-logs"), cwd=ROOT)
    saved = {name: os.environ.pop(name) for name in _INFRA_VARS if name in os.environ}
    try:
        worker = start_worker(supervisor, "worker-both", "both", default_model_dir)
        env = open_gateway_env(worker, default_model_dir, BATON_GATEWAY_PROCESSES="2", BATON_GRPC_PORT=str(free_port()))
        yield start_gateway(supervisor, "gateway", env)
    finally:
        supervisor.stop_all()
        os.environ.update(saved)


def _replicas(process: SupervisedProcess) -> list[int]:
    """The supervisor's children (its replicas), by pid."""
    assert process.pid is not None
    return [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stream(url: str) -> tuple[str, int]:
    """One streamed completion on a connection of its own: (the replica that served it, its chunks)."""
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
        return reply.headers[REPLICA], len(chunks)


def _finished(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^baton_gateway_generations_finished_total\{[^}]*\} (\S+)$', text, re.M))


def test_both_replicas_stay_up_sharing_the_http_and_grpc_ports(gateway: tuple[SupervisedProcess, str]) -> None:
    """A port one replica could not share (the internal gRPC API's, once) kills the others at start, again
    and again: after a few seconds the same two processes must still be serving."""
    process, url = gateway
    first = set(_replicas(process))
    time.sleep(3)
    assert set(_replicas(process)) == first and len(first) == 2
    assert "exited with code" not in process.log_tail(200)


def test_connections_spread_over_both_and_metrics_sum_them(gateway: tuple[SupervisedProcess, str]) -> None:
    process, url = gateway
    assert len(_replicas(process)) == 2
    before = _finished(url)
    served = [_stream(url) for _ in range(16)]
    assert {replica for replica, _ in served} == {"0", "1"}  # the kernel spread the 16 connections
    assert all(chunks == 4 for _, chunks in served)
    assert _finished(url) - before == 16  # whichever replica answers the scrape counts both


def test_a_killed_replica_is_replaced_while_the_other_serves(gateway: tuple[SupervisedProcess, str]) -> None:
    process, url = gateway
    victim = _replicas(process)[0]
    os.kill(victim, signal.SIGKILL)
    assert _stream(url)[1] == 4  # the survivor (or the replacement) answers at once
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = set(_replicas(process))
        if len(pids) == 2 and victim not in pids:
            break
        time.sleep(0.2)
    assert len(pids) == 2 and victim not in pids
    deadline = time.monotonic() + 30
    seen: set[str] = set()
    while seen != {"0", "1"} and time.monotonic() < deadline:  # the replacement takes connections too
        seen.add(_stream(url)[0])
    assert seen == {"0", "1"}


def test_sigterm_drains_every_replica_and_exits_zero(gateway: tuple[SupervisedProcess, str]) -> None:
    process, url = gateway
    replicas = _replicas(process)
    assert process.stop() == 0
    assert not any(_alive(pid) for pid in replicas)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/readyz", timeout=2)
