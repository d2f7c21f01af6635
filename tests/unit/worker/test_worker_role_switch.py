"""A running worker takes a new role when the scheduler asks (services/worker/role_switch.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from handoff_harness import build_engine, eventually, transfer_config

from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc as spb_grpc
from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from services.worker.config import WorkerConfig, WorkerRole
from services.worker.server import WorkerServer


@pytest.fixture
async def both_worker(tiny_model_dir: Path) -> AsyncIterator[WorkerServer]:
    config = WorkerConfig(role=WorkerRole.BOTH, model_id="tiny", worker_id="w", transfer=transfer_config(),
                          drain_grace_s=0.0)
    server = WorkerServer(config, build_engine(tiny_model_dir))
    await server.start()
    yield server
    await server.drain()


async def _generate(server: WorkerServer) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(request_id="g", prompt_token_ids=[5, 6, 7, 8],
                                     sampling=pb.SamplingParams(max_tokens=3, temperature=0.0))
        return [t for r in [r async for r in stub.Generate(request, timeout=30)] for t in r.token_ids]


async def test_a_both_worker_becomes_a_prefill_worker_and_back(both_worker: WorkerServer) -> None:
    assert await both_worker.role_switcher.apply("prefill")
    assert (await both_worker.status()).role == "prefill"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _generate(both_worker)  # a prefill worker does not decode
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert await both_worker.role_switcher.apply("both")
    assert (await both_worker.status()).role == "both"
    assert len(await _generate(both_worker)) == 3


async def test_a_both_worker_becoming_decode_gets_a_kv_link(both_worker: WorkerServer) -> None:
    assert await both_worker.role_switcher.apply("decode")
    assert (await both_worker.status()).role == "decode"
    assert len(await _generate(both_worker)) == 3  # no prefill peer: it prefills locally


async def test_the_current_or_an_unknown_role_changes_nothing(both_worker: WorkerServer) -> None:
    assert not await both_worker.role_switcher.apply("both")
    assert not await both_worker.role_switcher.apply("leader")
    assert both_worker.role_switcher.switches == 0


async def test_set_role_on_the_scheduler_switches_the_worker_through_its_heartbeats(tiny_model_dir: Path) -> None:
    scheduler = SchedulerService(SchedulerServiceConfig(host="127.0.0.1", port=0, drain_grace_s=0.0))
    await scheduler.start()
    config = WorkerConfig(role=WorkerRole.BOTH, model_id="tiny", worker_id="w", transfer=transfer_config(),
                          drain_grace_s=0.0, scheduler_address=f"127.0.0.1:{scheduler.port}",
                          heartbeat_interval_s=0.05)
    worker = WorkerServer(config, build_engine(tiny_model_dir))
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            stub = spb_grpc.SchedulerStub(channel)
            await eventually(lambda: "w" in scheduler.scheduler.live_worker_ids(time.monotonic()))
            await stub.SetRole(spb.SetRoleRequest(worker_id="w", role="prefill"), timeout=5)

            async def switched() -> bool:
                listed = await stub.ListWorkers(spb.ListWorkersRequest(), timeout=5)
                return [(w.status.role, w.HasField("role_switch")) for w in listed.workers] == [("prefill", False)]

            await eventually(switched, timeout_s=10.0)
        assert worker.role_switcher.switches == 1
    finally:
        await worker.drain()
        await scheduler.stop()
