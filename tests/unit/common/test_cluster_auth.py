"""The cluster token on a real in-process scheduler: calls without it (or with a wrong one) are refused
UNAUTHENTICATED whatever their kind, health checks stay open, and a worker registers only with it."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from rpcgen.baton.v1 import worker_pb2 as wpb
from scheduler.adapters.admin import cmd_workers
from scheduler.adapters.server import SchedulerService, SchedulerServiceConfig
from services.common.cluster_auth import (
    METADATA_KEY,
    ROTATING_ENV,
    TOKEN_ENV,
    ClusterToken,
    bind_internal_port,
    internal_channel,
    internal_server,
)
from services.common.errors import ConfigError
from services.worker.heartbeat import HeartbeatClient, TelemetryBuffer

TOKEN = ClusterToken("the-cluster-token-of-this-test")
WRONG = ClusterToken("some-other-clusters-token-xyz")


@pytest.fixture
async def scheduler() -> AsyncIterator[SchedulerService]:
    service = SchedulerService(SchedulerServiceConfig(host="127.0.0.1", port=0, drain_grace_s=0, cluster_token=TOKEN))
    await service.start()
    yield service
    while _channels:
        await _channels.pop().close()
    await service.stop()


_channels: list[grpc.aio.Channel] = []  # a channel nobody holds is closed when collected


def _stub(service: SchedulerService, token: ClusterToken | None) -> scheduler_pb2_grpc.SchedulerStub:
    _channels.append(internal_channel(f"127.0.0.1:{service.port}", token))
    return scheduler_pb2_grpc.SchedulerStub(_channels[-1])


def _status(worker_id: str) -> wpb.WorkerStatus:
    return wpb.WorkerStatus(worker_id=worker_id, role="both", model="m", free_blocks=8, total_blocks=8, block_size=16,
                            max_num_seqs=4)


def _register_request(worker_id: str) -> spb.RegisterRequest:
    return spb.RegisterRequest(worker_id=worker_id, address="127.0.0.1:1", status=_status(worker_id))


def test_the_token_is_validated_and_never_shown() -> None:
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        ClusterToken("short")
    with pytest.raises(ConfigError):
        ClusterToken(" the-cluster-token-of-this-test")
    assert TOKEN.value not in repr(TOKEN)
    assert ClusterToken.from_environ({TOKEN_ENV: ""}) is None
    assert ClusterToken.from_environ({TOKEN_ENV: TOKEN.value}) == TOKEN
    assert ClusterToken.generate() != ClusterToken.generate()
    with pytest.raises(ConfigError, match=TOKEN_ENV):  # a rotating token alone would leave the ports open
        ClusterToken.from_environ({ROTATING_ENV: WRONG.value})


def test_during_a_rotation_both_tokens_are_admitted_and_only_the_current_one_is_sent() -> None:
    rotating = ClusterToken.from_environ({TOKEN_ENV: TOKEN.value, ROTATING_ENV: WRONG.value})
    assert rotating is not None and rotating.metadata == (METADATA_KEY, TOKEN.value)
    assert rotating.admits(TOKEN.value) and rotating.admits(WRONG.value.encode())
    assert not rotating.admits("a-third-token-nobody-set") and not rotating.admits(None)
    assert not TOKEN.admits(WRONG.value)


@pytest.mark.parametrize("token", [None, WRONG], ids=["no-token", "wrong-token"])
async def test_a_worker_without_the_token_cannot_register(scheduler: SchedulerService,
                                                          token: ClusterToken | None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _stub(scheduler, token).Register(_register_request("rogue"), timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    listed = await _stub(scheduler, TOKEN).ListWorkers(spb.ListWorkersRequest(), timeout=5)
    assert [w.status.worker_id for w in listed.workers] == []


async def test_every_kind_of_call_is_refused_without_the_token(scheduler: SchedulerService) -> None:
    stub = _stub(scheduler, None)
    with pytest.raises(grpc.aio.AioRpcError) as listed:
        await stub.ListWorkers(spb.ListWorkersRequest(), timeout=5)
    stream = stub.Route(spb.RouteRequest(request_id="r"), timeout=5)  # server-streaming
    with pytest.raises(grpc.aio.AioRpcError) as routed:
        async for _ in stream:
            pass
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
    _channels.append(channel)
    unknown = channel.unary_unary("/baton.v1.Scheduler/NoSuchMethod")
    with pytest.raises(grpc.aio.AioRpcError) as probed:  # what exists is not revealed either
        await unknown(b"", timeout=5, metadata=((METADATA_KEY, WRONG.value),))
    assert [e.value.code() for e in (listed, routed, probed)] == [grpc.StatusCode.UNAUTHENTICATED] * 3


async def test_health_checks_need_no_token_but_listing_the_services_does(scheduler: SchedulerService) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
    _channels.append(channel)
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="baton.v1.Scheduler"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as listed:
        await channel.unary_unary("/grpc.health.v1.Health/List")(b"", timeout=5)
    assert listed.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def _heartbeat_client(service: SchedulerService, worker_id: str, token: ClusterToken) -> HeartbeatClient:
    async def status() -> wpb.WorkerStatus:
        return _status(worker_id)

    async def collect() -> None:
        return None

    return HeartbeatClient(f"127.0.0.1:{service.port}", worker_id, "127.0.0.1:1", status, collect, TelemetryBuffer(),
                           interval_s=0.05, cluster_token=token)


async def test_only_the_worker_with_the_token_is_registered_and_routed_to(scheduler: SchedulerService) -> None:
    ours, rogue = (await _heartbeat_client(scheduler, "ours", TOKEN),
                   await _heartbeat_client(scheduler, "rogue", WRONG))
    tasks = [asyncio.create_task(c.run()) for c in (ours, rogue)]
    try:
        for _ in range(100):
            if ours.heartbeats_sent >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        for client, task in zip((ours, rogue), tasks, strict=True):
            await client.stop()
            task.cancel()
    listed = await _stub(scheduler, TOKEN).ListWorkers(spb.ListWorkersRequest(), timeout=5)
    assert [w.status.worker_id for w in listed.workers] == ["ours"]
    assert (ours.registered, rogue.registered, rogue.heartbeats_sent) == (True, False, 0)


async def test_the_admin_cli_sends_the_token_of_its_environment(scheduler: SchedulerService,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(scheduler=f"127.0.0.1:{scheduler.port}", json=True)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    refused = await asyncio.to_thread(cmd_workers, args)
    assert refused == 2 and "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, TOKEN.value)
    assert await asyncio.to_thread(cmd_workers, args) == 0
    assert capsys.readouterr().out.strip() == "[]"


async def test_an_internal_port_another_server_holds_is_refused_not_shared(scheduler: SchedulerService) -> None:
    """gRPC binds with SO_REUSEPORT unless told not to: a second server would then share the port and
    callers would reach either one at random."""
    second = internal_server(TOKEN, "second")
    with pytest.raises(OSError, match=f"127.0.0.1:{scheduler.port}: address already in use"):
        bind_internal_port(second, f"127.0.0.1:{scheduler.port}")
    await second.stop(None)
