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

Heartbeats go out from a thread of their own, with a blocking gRPC channel of their own, never from
the worker's event loop: a heartbeat that waited for the engine thread (the status is read between
steps) or for the event loop went silent for as long as the longest step, and under load on a CPU one
long prompt's prefill kept a decode worker quiet for over 10 s; the scheduler dropped it as dead and
its requests failed with `no_live_worker_for_model`. The scheduler's liveness tolerance
(docs/operations.md, "Heartbeats and liveness") now bounds how long the whole process may stall,
not how long a step may take.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from engine.block_manager import KVEvent, KVEventKind
from engine.kv_tiers.types import KVTier
from engine.step_stats import StepStats
from rpcgen.baton.v1 import scheduler_pb2 as spb
from rpcgen.baton.v1 import scheduler_pb2_grpc
from rpcgen.baton.v1 import worker_pb2 as pb
from services.common.cluster_auth import ClusterToken, sync_internal_channel

log = logging.getLogger(__name__)
_UINT64 = (1 << 64) - 1
_TIERS = {KVTier.GPU: spb.KVEvent.TIER_GPU, KVTier.HOST: spb.KVEvent.TIER_HOST, KVTier.DISK: spb.KVEvent.TIER_DISK}
_RPC_TIMEOUT_S = 5.0
_MAX_BACKOFF_S = 10.0


class TelemetryBuffer:
    """Step samples (from the engine thread) and KV events, bounded; thread-safe."""

    def __init__(self, max_samples: int = 1024, max_events: int = 100_000) -> None:
        self._samples: deque[spb.StepSample] = deque(maxlen=max_samples)
        self._events: deque[spb.KVEvent] = deque(maxlen=max_events)
        # block hash -> its tier (spb.KVEvent.Tier), per every KV event added so far: what the worker holds
        self._held: dict[int, spb.KVEvent.Tier] = {}
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
                                 else spb.KVEvent.KIND_EVICTED, block_hash=e.block_hash & _UINT64,
                                 tier=_TIERS[e.tier])
                     for e in events]
        with self._lock:
            for event in converted:
                if event.kind == spb.KVEvent.KIND_STORED:
                    self._held[event.block_hash] = event.tier
                else:
                    self._held.pop(event.block_hash, None)
            self._events.extend(converted)

    def announce_held(self) -> None:
        """After a registration: the pending events become one STORED event per hash held now."""
        with self._lock:
            self._events.clear()
            self._events.extend(spb.KVEvent(kind=spb.KVEvent.KIND_STORED, block_hash=h, tier=tier)
                                for h, tier in self._held.items())

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
    """Registration and heartbeats from a thread of their own (see the module docstring: why).

    The status and the KV events are still read on the worker's event loop (they need the engine
    thread, between steps), but the heartbeat thread waits for them at most `status_timeout_s`: while
    a step runs longer it sends the last status it has, so the scheduler hears from a busy worker at
    every interval. At most one status read and one KV-event collection are in flight at a time, so a
    long step does not pile reads up on the engine thread.
    """

    def __init__(self, scheduler_address: str, worker_id: str, advertise_address: str,
                 status: Callable[[], Awaitable[pb.WorkerStatus]], collect: Callable[[], Awaitable[None]],
                 buffer: TelemetryBuffer, interval_s: float,
                 on_switch_role: Callable[[str], Awaitable[object]] | None = None,
                 status_timeout_s: float | None = None, cluster_token: ClusterToken | None = None) -> None:
        """`collect()` moves fresh KV events into `buffer` (it runs on the engine thread);
        `on_switch_role(role)` takes a role the scheduler asks for (services/worker/role_switch.py);
        all three run on the event loop that calls `run()`. `status_timeout_s`: how long a heartbeat
        waits for a fresh status (default: half the interval)."""
        self._address = scheduler_address
        self._worker_id = worker_id
        self._advertise = advertise_address
        self._status = status
        self._collect = collect
        self._buffer = buffer
        self._interval_s = interval_s
        self._status_timeout_s = status_timeout_s
        self._on_switch_role = on_switch_role
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_status: pb.WorkerStatus | None = None
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}  # what the loop still runs for us
        self._cluster_token = cluster_token  # the scheduler refuses registrations and heartbeats without it
        self.registered = False
        self.heartbeats_sent = 0
        self.stale_heartbeats = 0  # sent with the previous status: the engine was mid-step

    async def run(self) -> None:
        """Register, then heartbeat every interval from a thread of its own until `stop()`; never
        raises on RPC errors."""
        self._loop = asyncio.get_running_loop()
        done = self._loop.create_future()
        thread = threading.Thread(target=self._thread_main, args=(done,), name="heartbeat", daemon=True)
        thread.start()
        await done

    async def stop(self) -> None:
        self._stop.set()

    # ---- the heartbeat thread ------------------------------------------------------------------

    def _thread_main(self, done: asyncio.Future[None]) -> None:
        channel = sync_internal_channel(self._address, self._cluster_token)
        try:
            self._beat_until_stopped(scheduler_pb2_grpc.SchedulerStub(channel))
        finally:
            channel.close()
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self._loop.call_soon_threadsafe(_resolve, done)

    def _beat_until_stopped(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        backoff, outage = self._interval_s, False
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register(stub)
                self._heartbeat(stub)
                backoff, outage = self._interval_s, False
            except grpc.RpcError as e:
                self.registered = False
                if not outage:
                    why = "refused this worker's cluster token" if _code(e) == "UNAUTHENTICATED" else "unreachable"
                    log.warning("scheduler %s %s (%s); serving on, retrying", self._address, why, _code(e))
                outage, backoff = True, min(backoff * 2, _MAX_BACKOFF_S)
            except _LoopGone:
                return
            self._stop.wait(backoff if outage else self._interval_s)

    def _register(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        status = self._read_status(wait_s=_RPC_TIMEOUT_S)  # a registration needs a real status
        response = stub.Register(
            spb.RegisterRequest(worker_id=self._worker_id, address=self._advertise, status=status),
            timeout=_RPC_TIMEOUT_S)
        if response.heartbeat_interval_s > 0:
            self._interval_s = response.heartbeat_interval_s
        self.registered = True
        self._buffer.announce_held()
        log.info("registered with scheduler %s as %s", self._address, self._worker_id)

    def _heartbeat(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        wait_s = self._interval_s / 2 if self._status_timeout_s is None else self._status_timeout_s
        self._on_loop("collect", self._collect, wait_s)
        status = self._read_status(wait_s)
        samples, events = self._buffer.take()
        try:
            response = stub.Heartbeat(spb.HeartbeatRequest(status=status, samples=samples, kv_events=events),
                                      timeout=_RPC_TIMEOUT_S)
        except grpc.RpcError:
            self._buffer.put_back(samples, events)
            raise
        self.heartbeats_sent += 1
        if not response.known:
            log.warning("scheduler %s forgot this worker; registering again", self._address)
            self.registered = False
        elif response.switch_to_role and self._on_switch_role is not None:
            on_switch, role = self._on_switch_role, response.switch_to_role
            self._on_loop("switch", lambda: on_switch(role), 0.0)

    def _read_status(self, wait_s: float) -> pb.WorkerStatus:
        """A fresh status if the loop and the engine give one within `wait_s`, else the last one."""
        fresh = self._on_loop("status", self._status, wait_s)
        if fresh is not None:
            self._last_status = fresh
        elif self._last_status is not None:
            self.stale_heartbeats += 1
        else:  # none yet: wait for the first one (a registration cannot go without it)
            fresh = self._on_loop("status", self._status, _RPC_TIMEOUT_S)
            self._last_status = fresh if fresh is not None else pb.WorkerStatus(worker_id=self._worker_id)
        return self._last_status

    def _on_loop(self, name: str, call: Callable[[], Awaitable[Any]], wait_s: float) -> Any:
        """Run `call()` on the worker's loop (one of each `name` in flight) and wait up to `wait_s`
        for its result; None when it is not done by then (it finishes later, on its own)."""
        assert self._loop is not None
        future = self._pending.get(name)
        if future is None or future.done():
            try:
                future = asyncio.run_coroutine_threadsafe(_awaited(call), self._loop)
            except RuntimeError as e:  # the worker's loop is closed: the worker is stopping
                raise _LoopGone from e
            self._pending[name] = future
        try:
            result = future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - a failed read is logged; the heartbeat goes on without it
            log.exception("heartbeat: %s failed", name)
            return None
        del self._pending[name]
        return result


class _LoopGone(Exception):
    """The worker's event loop closed under the heartbeat thread."""


async def _awaited(call: Callable[[], Awaitable[Any]]) -> Any:
    return await call()


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _code(error: grpc.RpcError) -> str:
    code = error.code() if isinstance(error, grpc.Call) else None
    return code.name if code is not None else type(error).__name__
