"""Registration and heartbeats to the scheduler: status, step-time samples and KV events.

The scheduler is advisory for a worker: if it is unreachable the worker keeps serving and retries
(with backoff, logging once per outage). Step samples and KV events wait in bounded buffers; those
taken for a heartbeat that failed go back to the front, so a short outage loses nothing, and a long
one drops the oldest (the scheduler's prefix index is a hint, and it ages entries out anyway).

A (re)registration starts this worker's entry in the scheduler's prefix index empty (a restarted
scheduler, or one that timed the worker out), so the buffer keeps the set of hashes the worker holds,
as the KV events so far tell it, and a registration replaces the pending events with one STORED event
per held hash: the scheduler relearns the cache the worker already has, not only what it stores next.
Events collected later are applied after that snapshot, in order, so the index converges.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable

import grpc

from engine.block_manager import KVEvent, KVEventKind
from engine.step_stats import StepStats
from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from rpcgen.baton.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
_UINT64 = (1 << 64) - 1
_RPC_TIMEOUT_S = 5.0
_MAX_BACKOFF_S = 10.0


class TelemetryBuffer:
    """Step samples (from the engine thread) and KV events, bounded; thread-safe."""

    def __init__(self, max_samples: int = 1024, max_events: int = 100_000) -> None:
        self._samples: deque[spb.StepSample] = deque(maxlen=max_samples)
        self._events: deque[spb.KVEvent] = deque(maxlen=max_events)
        self._held: set[int] = set()  # block hashes the worker holds, per every KV event added so far
        self._lock = threading.Lock()

    def add_step(self, stats: StepStats) -> None:
        """Record a step-time sample of its kind. A step that mixes prefill chunks with decodes is its
        own kind: counted as a prefill and again as a decode, its whole time would inflate both of the
        scheduler's fits; as a mixed sample it tells what the decodes add to a step carrying a prompt.
        The time is the served one (`StepStats.period_seconds`): the scheduler predicts clients' token
        gaps and queue waits from these samples, and both run at the engine loop's pace, not the
        forward pass's."""
        seconds = stats.period_seconds
        if stats.prefill_tokens and stats.decode_seqs:
            sample = spb.StepSample(kind=spb.StepSample.KIND_MIXED, tokens=stats.prefill_tokens,
                                    attention_tokens_sq=stats.attention_tokens_sq, decode_seqs=stats.decode_seqs,
                                    context_tokens=stats.decode_context_tokens, seconds=seconds)
        elif stats.prefill_tokens:
            sample = spb.StepSample(kind=spb.StepSample.KIND_PREFILL, tokens=stats.prefill_tokens,
                                    seconds=seconds, attention_tokens_sq=stats.attention_tokens_sq)
        elif stats.decode_seqs:
            sample = spb.StepSample(kind=spb.StepSample.KIND_DECODE, tokens=stats.decode_seqs,
                                    context_tokens=stats.decode_context_tokens, seconds=seconds)
        else:
            return
        with self._lock:
            self._samples.append(sample)

    def add_kv_events(self, events: list[KVEvent]) -> None:
        converted = [spb.KVEvent(kind=spb.KVEvent.KIND_STORED if e.kind is KVEventKind.STORED
                                 else spb.KVEvent.KIND_EVICTED, block_hash=e.block_hash & _UINT64)
                     for e in events]
        with self._lock:
            for event in converted:
                if event.kind == spb.KVEvent.KIND_STORED:
                    self._held.add(event.block_hash)
                else:
                    self._held.discard(event.block_hash)
            self._events.extend(converted)

    def announce_held(self) -> None:
        """After a registration: the pending events become one STORED event per hash held now."""
        with self._lock:
            self._events.clear()
            self._events.extend(spb.KVEvent(kind=spb.KVEvent.KIND_STORED, block_hash=h) for h in self._held)

    def take(self) -> tuple[list[spb.StepSample], list[spb.KVEvent]]:
        with self._lock:
            samples, events = list(self._samples), list(self._events)
            self._samples.clear()
            self._events.clear()
        return samples, events

    def put_back(self, samples: list[spb.StepSample], events: list[spb.KVEvent]) -> None:
        """Return what a failed heartbeat took, ahead of anything newer (order matters for KV events)."""
        with self._lock:
            self._samples.extendleft(reversed(samples))
            self._events.extendleft(reversed(events))


class HeartbeatClient:
    def __init__(self, scheduler_address: str, worker_id: str, advertise_address: str,
                 status: Callable[[], Awaitable[pb.WorkerStatus]], collect: Callable[[], Awaitable[None]],
                 buffer: TelemetryBuffer, interval_s: float,
                 on_switch_role: Callable[[str], Awaitable[object]] | None = None) -> None:
        """`collect()` moves fresh KV events into `buffer` (it runs on the engine thread);
        `on_switch_role(role)` takes a role the scheduler asks for (services/worker/role_switch.py)."""
        self._address = scheduler_address
        self._worker_id = worker_id
        self._advertise = advertise_address
        self._status = status
        self._collect = collect
        self._buffer = buffer
        self._interval_s = interval_s
        self._on_switch_role = on_switch_role
        self._channel = grpc.aio.insecure_channel(scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._stop = asyncio.Event()
        self.registered = False
        self.heartbeats_sent = 0

    async def run(self) -> None:
        """Register, then heartbeat every interval until `stop()`; never raises on RPC errors."""
        backoff, outage = self._interval_s, False
        while not self._stop.is_set():
            try:
                if not self.registered:
                    await self._register()
                await self._heartbeat()
                backoff, outage = self._interval_s, False
            except grpc.aio.AioRpcError as e:
                self.registered = False
                if not outage:
                    log.warning("scheduler %s unreachable (%s); serving on, retrying", self._address, e.code().name)
                outage, backoff = True, min(backoff * 2, _MAX_BACKOFF_S)
            await self._sleep(backoff if outage else self._interval_s)

    async def stop(self) -> None:
        self._stop.set()
        await self._channel.close()

    async def _register(self) -> None:
        status = await self._status()
        response = await self._stub.Register(
            spb.RegisterRequest(worker_id=self._worker_id, address=self._advertise, status=status),
            timeout=_RPC_TIMEOUT_S)
        if response.heartbeat_interval_s > 0:
            self._interval_s = response.heartbeat_interval_s
        self.registered = True
        self._buffer.announce_held()
        log.info("registered with scheduler %s as %s", self._address, self._worker_id)

    async def _heartbeat(self) -> None:
        await self._collect()
        status = await self._status()
        samples, events = self._buffer.take()
        try:
            response = await self._stub.Heartbeat(
                spb.HeartbeatRequest(status=status, samples=samples, kv_events=events), timeout=_RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            self._buffer.put_back(samples, events)
            raise
        self.heartbeats_sent += 1
        if not response.known:
            log.warning("scheduler %s forgot this worker; registering again", self._address)
            self.registered = False
        elif response.switch_to_role and self._on_switch_role is not None:
            await self._on_switch_role(response.switch_to_role)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()
