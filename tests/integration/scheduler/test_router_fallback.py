"""A real scheduler process (`python -m scheduler.adapters`): the gateway's RouterClient keeps
routing on its last view when the process is SIGKILLed and returns to the scheduler once it is
restarted; SIGTERM drains it and exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from rpcgen.baton.v1 import worker_pb2
from scheduler.types import SLO, RequestSummary, Tier
from services.gateway.routing.router_client import RouteKind, RouterClient, RouterConfig, RouteSource
from tests.support.scheduler_process import SchedulerProcess

WORKERS = {"a": "127.0.0.1:7101", "b": "127.0.0.1:7102"}


@pytest.fixture
def scheduler_process(tmp_path: Path) -> Iterator[SchedulerProcess]:
    process = SchedulerProcess(tmp_path / "scheduler.log", "least_loaded", "--heartbeat-timeout-s", "60")
    yield process
    process.kill()


async def _until_serving(address: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                answer = await health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Scheduler"), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            assert time.monotonic() < deadline, "scheduler process did not become healthy"
            await asyncio.sleep(0.1)


async def _register_workers(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for worker_id, worker_address in WORKERS.items():
            status = worker_pb2.WorkerStatus(worker_id=worker_id, role="decode", model="m", free_blocks=1000,
                                             total_blocks=1000, block_size=16)
            await stub.Register(pb.RegisterRequest(worker_id=worker_id, address=worker_address, status=status),
                                timeout=5)


def _summary(request_id: str) -> RequestSummary:
    return RequestSummary(request_id, 64, (1, 2, 3, 4), Tier.FREE, SLO(2000, 100), 32)


async def test_router_falls_back_to_its_last_view_when_the_scheduler_dies_and_recovers(
    scheduler_process: SchedulerProcess,
) -> None:
    address = f"127.0.0.1:{scheduler_process.port}"
    scheduler_process.start()
    await _until_serving(address)
    await _register_workers(address)
    client = RouterClient(address, config=RouterConfig(retry_scheduler_after_s=0.2))
    first = await client.route(_summary("r0"))
    assert (first.source, first.kind) == (RouteSource.SCHEDULER, RouteKind.ROUTE)
    assert await client.refresh_view()

    scheduler_process.kill()  # SIGKILL: no drain, no goodbye
    fallback = [await client.route(_summary(f"f{i}")) for i in range(4)]
    assert {d.source for d in fallback} == {RouteSource.LAST_VIEW}
    assert {d.decode_address for d in fallback} == set(WORKERS.values())  # spread, not herded
    assert not client.scheduler_available

    scheduler_process.start()  # same port: the gateway's configured address
    await _until_serving(address)
    await _register_workers(address)
    deadline = time.monotonic() + 10
    while (decision := await client.route(_summary(f"after{time.monotonic()}"))).source is not RouteSource.SCHEDULER:
        assert time.monotonic() < deadline, "the client never went back to the scheduler"
        await asyncio.sleep(0.1)
    assert decision.kind is RouteKind.ROUTE and decision.decode_address in WORKERS.values()
    await client.close()


async def test_sigterm_drains_and_exits_zero_after_serving_metrics(scheduler_process: SchedulerProcess) -> None:
    address = f"127.0.0.1:{scheduler_process.port}"
    scheduler_process.start()
    await _until_serving(address)
    await _register_workers(address)
    url = f"http://127.0.0.1:{scheduler_process.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert "baton_scheduler_registrations_total 2.0" in text
    assert scheduler_process.proc is not None
    scheduler_process.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(scheduler_process.proc.wait, 10) == 0
