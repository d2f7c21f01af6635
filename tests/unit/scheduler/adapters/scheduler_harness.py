"""Builders for scheduler-service tests: worker statuses, route requests, and a `Cluster` (a real
service on a free port with a manual clock, and a stub speaking to it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from rpcgen.baton.v1 import worker_pb2
from scheduler.adapters.clock import ManualClock
from scheduler.adapters.server import SchedulerService

HEARTBEAT_TIMEOUT_S = 3.0


def status(worker_id: str, role: str = "decode", **overrides: Any) -> worker_pb2.WorkerStatus:
    fields: dict[str, Any] = {
        "worker_id": worker_id,
        "role": role,
        "model": "m",
        "free_blocks": 1000,
        "total_blocks": 1000,
        "block_size": 16,
    }
    fields.update(overrides)
    return worker_pb2.WorkerStatus(**fields)


def address(worker_id: str) -> str:
    return f"{worker_id}.workers.test:7000"


def route_request(
    request_id: str,
    prompt: int = 512,
    tier: str = "free",
    ttft_ms: float = 2000,
    tpot_ms: float = 100,
    max_tokens: int = 64,
    hashes: list[int] | None = None,
) -> pb.RouteRequest:
    return pb.RouteRequest(
        request_id=request_id,
        num_prompt_tokens=prompt,
        prefix_block_hashes=list(range(1, prompt // 16 + 1)) if hashes is None else hashes,
        tier=tier,
        slo=pb.SLO(ttft_ms=ttft_ms, tpot_ms=tpot_ms),
        max_tokens=max_tokens,
    )


class Cluster:
    """The service under test, its manual clock, and a stub speaking to it over a real channel."""

    def __init__(self, service: SchedulerService, clock: ManualClock, channel: grpc.aio.Channel) -> None:
        self.service = service
        self.clock = clock
        self.channel = channel
        self.stub = pb_grpc.SchedulerStub(channel)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.service.port}"

    async def register(self, worker_id: str, role: str = "decode", **overrides: Any) -> pb.RegisterResponse:
        request = pb.RegisterRequest(
            worker_id=worker_id, address=address(worker_id), status=status(worker_id, role, **overrides)
        )
        return await self.stub.Register(request, timeout=5)

    async def heartbeat(self, worker_id: str, role: str = "decode", **kwargs: Any) -> bool:
        samples = kwargs.pop("samples", [])
        kv_events = kwargs.pop("kv_events", [])
        request = pb.HeartbeatRequest(status=status(worker_id, role, **kwargs), samples=samples, kv_events=kv_events)
        return (await self.stub.Heartbeat(request, timeout=5)).known

    async def route(self, request: pb.RouteRequest, timeout: float = 5) -> pb.RouteResponse:
        """The final answer of a Route stream (one that was not queued has only that message)."""
        answers = [answer async for answer in self.stub.Route(request, timeout=timeout)]
        assert answers and answers[-1].kind != pb.RouteResponse.KIND_QUEUE
        return answers[-1]

    async def queued_route(self, request: pb.RouteRequest, timeout: float = 5) -> Any:
        """Start a Route that must be queued; returns the open call, its QUEUE message read."""
        call = self.stub.Route(request, timeout=timeout)
        first = await call.read()
        assert first.kind == pb.RouteResponse.KIND_QUEUE, first
        return call

    async def until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Poll (the service runs on this loop) until `condition` holds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
            await asyncio.sleep(0.01)


StartCluster = Callable[..., Awaitable[Cluster]]
