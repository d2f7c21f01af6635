"""Heartbeat client against an in-process scheduler: retries while it is down, buffers survive."""

from __future__ import annotations

import asyncio

import grpc

from engine.block_manager import KVEvent, KVEventKind
from engine.kv_tiers.types import KVTier
from engine.step_stats import StepStats
from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from rpcgen.baton.v1 import worker_pb2 as pb
from services.worker.heartbeat import HeartbeatClient, TelemetryBuffer


class Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, forget_first: bool = False) -> None:
        self.registrations: list[spb.RegisterRequest] = []
        self.heartbeats: list[spb.HeartbeatRequest] = []
        self.forget_first = forget_first

    async def Register(self, request, context):  # noqa: N802
        self.registrations.append(request)
        return spb.RegisterResponse(heartbeat_interval_s=0.05)

    async def Heartbeat(self, request, context):  # noqa: N802
        self.heartbeats.append(request)
        known = not (self.forget_first and len(self.heartbeats) == 1)
        return spb.HeartbeatResponse(known=known)


def test_buffer_puts_failed_items_back_in_order() -> None:
    buf = TelemetryBuffer()
    buf.add_kv_events([KVEvent(KVEventKind.STORED, 1), KVEvent(KVEventKind.EVICTED, 2)])
    buf.add_step(StepStats(prefill_tokens=10, attention_tokens_sq=100, decode_seqs=0, decode_context_tokens=0,
                           seconds=0.1))
    buf.add_step(StepStats(prefill_tokens=0, attention_tokens_sq=0, decode_seqs=2, decode_context_tokens=50,
                           seconds=0.05))
    samples, events = buf.take()
    buf.add_kv_events([KVEvent(KVEventKind.STORED, 3)])
    buf.put_back(samples, events)
    samples2, events2 = buf.take()
    assert [e.block_hash for e in events2] == [1, 2, 3]
    assert [(s.kind, s.tokens) for s in samples2] == [(spb.StepSample.KIND_PREFILL, 10),
                                                      (spb.StepSample.KIND_DECODE, 2)]


def test_a_mixed_prefill_and_decode_step_is_reported_once_as_its_own_kind() -> None:
    buf = TelemetryBuffer()
    buf.add_step(StepStats(prefill_tokens=10, attention_tokens_sq=100, decode_seqs=2, decode_context_tokens=50,
                           seconds=0.1))
    (sample,) = buf.take()[0]
    assert (sample.kind, sample.tokens, sample.attention_tokens_sq, sample.decode_seqs, sample.context_tokens,
            sample.seconds) == (spb.StepSample.KIND_MIXED, 10, 100, 2, 50, 0.1)


def test_negative_hashes_travel_as_uint64() -> None:
    buf = TelemetryBuffer()
    buf.add_kv_events([KVEvent(KVEventKind.STORED, -1)])
    assert buf.take()[1][0].block_hash == 2**64 - 1


def test_kv_events_carry_their_tier_and_a_re_registration_announces_it() -> None:
    buf = TelemetryBuffer()
    buf.add_kv_events([KVEvent(KVEventKind.STORED, 1, KVTier.HOST), KVEvent(KVEventKind.STORED, 2, KVTier.DISK),
                       KVEvent(KVEventKind.STORED, 3)])
    assert [e.tier for e in buf.take()[1]] == [spb.KVEvent.TIER_HOST, spb.KVEvent.TIER_DISK, spb.KVEvent.TIER_GPU]
    buf.add_kv_events([KVEvent(KVEventKind.EVICTED, 2, KVTier.DISK)])
    buf.announce_held()
    assert {(e.block_hash, e.tier) for e in buf.take()[1]} == {(1, spb.KVEvent.TIER_HOST), (3, spb.KVEvent.TIER_GPU)}


async def _client(port: int, buffer: TelemetryBuffer) -> HeartbeatClient:
    async def status() -> pb.WorkerStatus:
        return pb.WorkerStatus(worker_id="w", role="decode", total_blocks=8)

    async def collect() -> None:
        buffer.add_kv_events([KVEvent(KVEventKind.STORED, 7)])

    return HeartbeatClient(f"127.0.0.1:{port}", "w", "127.0.0.1:1", status, collect, buffer, interval_s=0.05)


async def _serve(scheduler: Scheduler, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def test_registers_once_the_scheduler_comes_up_and_keeps_nothing_lost() -> None:
    scheduler = Scheduler()
    server, port = await _serve(scheduler)
    await server.stop(0)  # down at first: the client must keep retrying
    buffer = TelemetryBuffer()
    client = await _client(port, buffer)
    task = asyncio.create_task(client.run())
    await asyncio.sleep(0.3)
    assert not client.registered
    server, _ = await _serve(scheduler, port)
    try:
        for _ in range(200):
            if len(scheduler.heartbeats) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.stop()
        task.cancel()
        await server.stop(0)
    assert scheduler.registrations[0].worker_id == "w"
    assert scheduler.registrations[0].status.total_blocks == 8
    hashes = [e.block_hash for h in scheduler.heartbeats for e in h.kv_events]
    assert hashes.count(7) >= 2  # events collected while down were kept and sent


async def test_registers_again_when_the_scheduler_forgot_the_worker() -> None:
    scheduler = Scheduler(forget_first=True)
    server, port = await _serve(scheduler)
    client = await _client(port, TelemetryBuffer())
    task = asyncio.create_task(client.run())
    try:
        for _ in range(200):
            if len(scheduler.registrations) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.stop()
        task.cancel()
        await server.stop(0)
    assert len(scheduler.registrations) >= 2
