"""Prefill side of disaggregation: compute a prompt, sample its first token, WRITE its KV to a decode worker.

One `Prefill` RPC is one job, run as a task of its own so that neither the RPC's cancellation nor the
decode worker's `Abort` can skip its cleanup:

    queued/delayed -> prefilling in the engine (batched with other prefills) -> blocks HELD (and
    checksummed, in the step that finished them) -> WRITE in flight -> terminal -> response; the
    held blocks are released to the engine without waiting for it

Dangerous window: the held blocks are the WRITE's source. They are released only once the transfer
is terminal (NIXL let go of them), never on abort alone; the engine's hold lease (longer than the
transfer deadline) is the backstop if this process loses track of a job. The job answers only once
nothing more can land in the decode worker's blocks, which is what the `baton-kv-idle` trailer
promises (see worker.proto).

Nothing on this path waits for an engine step after the prefill's own: the hold output carries the
block table and checksums, the WRITE's DONE notice carries the first token (the decode worker
commits on it, not on this RPC's answer), and the blocks are handed back fire-and-forget.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import AsyncEngine
from engine.batch import TokenLogprobs
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason, HeldBlocks, RequestOutput
from kvtransfer.base import HandoffPayload, HandshakeInfo, TransferPlan, TransferState
from kvtransfer.errors import UnknownPeerError
from services.worker.config import TransferConfig
from services.worker.faults import WorkerFaults
from services.worker.intake import Intake
from services.worker.kv_link import KVLink, TransferResult
from services.worker.metrics import HandoffPhase, WorkerMetrics
from services.worker.prefill_order import PrefillDestination, PrefillOrder
from services.worker.prefill_stream import ChunkForwarder

log = logging.getLogger(__name__)
_TOMBSTONE_S = 120.0  # an Abort that overtook its Prefill is remembered this long


class DrainingError(Exception):
    """The worker is draining (SIGTERM): it accepts no new work."""


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    state: TransferState  # terminal; CANCELLED = aborted (before or during the WRITE)
    reason: str = ""
    first_token_id: int | None = None
    first_logprobs: TokenLogprobs | None = None
    prefill_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    num_prefill_cached_tokens: int = 0


@dataclass
class _RunningOrder:
    order: PrefillOrder
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    prefilling: bool = True  # until the first token
    # Handed to the engine: from then on its remaining tokens are in the engine's pending prefill count.
    in_engine: bool = False
    task: asyncio.Task[PrefillResult] | None = None
    # Resolves with the order completed by its destination (at once unless `destination_follows`).
    placed: asyncio.Future[PrefillOrder] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    forwarder: ChunkForwarder | None = None  # streamed jobs: their chunk reports' way to the KV link


class PrefillService:
    def __init__(self, engine: AsyncEngine, link: KVLink, config: TransferConfig, faults: WorkerFaults,
                 metrics: WorkerMetrics, block_size: int, intake: Intake | None = None) -> None:
        """`intake`: counts each job once it joins this worker's jobs (services/worker/intake.py)."""
        self._engine = engine
        self._intake = intake or Intake()
        self._link = link
        self._config = config
        self._faults = faults
        self._metrics = metrics
        self._block_size = block_size
        self._peers: set[str] = set()
        self._jobs: dict[str, _RunningOrder] = {}
        self._tombstones: dict[str, float] = {}
        self._early: dict[str, tuple[PrefillDestination, float]] = {}  # destinations ahead of their Prefill
        self.draining = False

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def unsubmitted_prefill(self) -> tuple[int, int]:
        """(prompt tokens, prompts) of jobs not handed to the engine yet (queued behind a delay, or just
        arrived): the engine's pending count does not hold them, and the scheduler must."""
        waiting = [len(j.order.prompt) for j in self._jobs.values() if j.prefilling and not j.in_engine]
        return sum(waiting), len(waiting)

    async def handshake(self, decode: HandshakeInfo) -> HandshakeInfo:
        """Check the decode worker's layout (IncompatiblePeerError names each field), connect once."""
        name = await self._link.add_peer(decode)
        self._peers.add(name)
        return self._link.handshake_info

    async def prefill(self, order: PrefillOrder) -> PrefillResult:
        """Run one job to its terminal state. Raises (nothing started) InvalidRequestError,
        UnknownPeerError or DrainingError. If the caller is cancelled, the job is aborted and
        finishes on its own (its blocks are released only once its WRITE is terminal)."""
        self._check(order)
        if self._tombstones.pop(order.request_id, None) is not None:
            return PrefillResult(order.request_id, TransferState.CANCELLED, "aborted before it arrived")
        job = _RunningOrder(order)
        if not order.destination_follows:
            job.placed.set_result(order)
        self._jobs[order.request_id] = job
        early = self._early.pop(order.request_id, None)
        if early is not None:
            self.place(early[0])
        job.task = asyncio.create_task(self._run(job), name=f"prefill-{order.request_id}")
        self._intake.take()  # the status counts it from now on: unsubmitted, then in the engine
        job.task.add_done_callback(lambda _: self._jobs.pop(order.request_id, None))
        try:
            return await asyncio.shield(job.task)
        except asyncio.CancelledError:
            job.aborted.set()  # the decode side gave up on the RPC: stop early, clean up alone
            raise

    def place(self, destination: PrefillDestination) -> str:
        """A `destination_follows` job's decode blocks; "" when taken, else why not (InvalidRequestError
        for ids that do not fit the prompt). One that overtook its Prefill waits for it (as an Abort does)."""
        job = self._jobs.get(destination.request_id)
        if job is None:
            now = time.monotonic()
            self._early = {rid: e for rid, e in self._early.items() if e[1] > now}
            self._early[destination.request_id] = (destination, now + _TOMBSTONE_S)
            return ""
        if job.order.attempt != destination.attempt or job.placed.done():
            return f"job {destination.request_id!r} attempt {job.order.attempt} is not waiting for a destination"
        order = job.order.with_destination(destination)
        self._check_blocks(order)
        job.order = order
        job.placed.set_result(order)
        if job.forwarder is not None:
            job.forwarder.place(order)
        return ""

    def abort(self, request_id: str) -> bool:
        """Abort a job at any phase; returns whether it was known. An unknown id is remembered so a
        Prefill that arrives after its Abort is refused at once (the two RPCs race)."""
        job = self._jobs.get(request_id)
        if job is None:
            now = time.monotonic()
            self._tombstones = {rid: t for rid, t in self._tombstones.items() if t > now}
            self._tombstones[request_id] = now + _TOMBSTONE_S
            return False
        job.aborted.set()
        return True

    def abort_all(self) -> None:
        for job in self._jobs.values():
            job.aborted.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        tasks = [j.task for j in self._jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return not self._jobs

    # ---- one job --------------------------------------------------------------------------------
    def _check(self, order: PrefillOrder) -> None:
        if self.draining:
            raise DrainingError("the prefill worker is draining")
        if order.decode_agent not in self._peers:
            raise UnknownPeerError(f"decode agent {order.decode_agent!r} has not done the Handshake")
        if order.request_id in self._jobs:
            raise InvalidRequestError(f"duplicate request id {order.request_id!r}")
        if not order.destination_follows:
            self._check_blocks(order)

    def _check_blocks(self, order: PrefillOrder) -> None:
        bs, n = self._block_size, len(order.prompt)
        if order.num_cached_tokens % bs or not 0 <= order.num_cached_tokens < n:
            raise InvalidRequestError(
                f"num_cached_tokens={order.num_cached_tokens} must be a multiple of block_size {bs} below {n}")
        want = -(-n // bs) - order.num_cached_tokens // bs
        if len(order.remote_block_ids) != want:
            raise InvalidRequestError(f"remote_block_ids has {len(order.remote_block_ids)} ids; "
                                      f"{n} prompt tokens with {order.num_cached_tokens} cached need {want}")

    async def _run(self, job: _RunningOrder) -> PrefillResult:
        order, start = job.order, time.monotonic()
        stream: asyncio.Future[TransferResult] | None = None
        try:
            if not await self._delay(job):
                return PrefillResult(order.request_id, TransferState.CANCELLED, "aborted before prefill")
            stream = self._open_stream(order)
            if stream is not None:
                job.forwarder = ChunkForwarder(self._link, order, self._block_size)
                if job.placed.done():
                    job.forwarder.place(job.placed.result())
            first = await self._first_token(job)
            job.prefilling = False
            if first is None or first.held is None:
                return PrefillResult(order.request_id, TransferState.CANCELLED, "aborted during prefill")
            held = first.held
            self._observe_prefill(start, held)
            prefill_s = time.monotonic() - start
            if job.aborted.is_set():
                return PrefillResult(order.request_id, TransferState.CANCELLED, "aborted after prefill")
            sent = await self._transfer(job, held, first, max(held.finished_at - start, 0.0), stream)
            self._metrics.transfer_seconds.labels(sent.state.value).observe(sent.seconds)
            if job.forwarder is not None:
                self._metrics.stream_parts.inc(job.forwarder.parts)
            after_prefill = max(time.monotonic() - held.finished_at, 0.0)
            self._metrics.handoff_phase(HandoffPhase.WRITE_AFTER_PREFILL, after_prefill)
            if sent.state is TransferState.DONE:
                self._metrics.transfer_bytes.inc(sent.num_bytes)
                self._metrics.handoff_phase(HandoffPhase.PREFILL_JOB, time.monotonic() - start)
            logprobs = first.logprobs[0] if first.logprobs else None
            return PrefillResult(order.request_id, sent.state, sent.reason, first.new_token_ids[0], logprobs,
                                 prefill_s, sent.seconds, sent.num_bytes, held.num_cached_tokens)
        finally:
            if stream is not None and not stream.done():  # never finished: see _end_stream
                await self._end_stream(order, stream)
            # Reached only once no WRITE reads the blocks (see _transfer); idempotent, and not waited
            # for: the answer (and the `baton-kv-idle` trailer) must not wait for an engine step.
            self._engine.release_held(order.request_id)

    def _observe_prefill(self, start: float, held: HeldBlocks) -> None:
        """Queue wait (RPC in -> first chunk scheduled) and compute (-> first token resolved)."""
        self._metrics.handoff_phase(HandoffPhase.QUEUE_WAIT, max(held.started_at - start, 0.0))
        self._metrics.handoff_phase(HandoffPhase.PREFILL_COMPUTE, max(held.finished_at - held.started_at, 0.0))

    async def _delay(self, job: _RunningOrder) -> bool:
        """Injected slowness (delay_prefill); False when aborted meanwhile."""
        delay = self._faults.take_prefill_delay()
        if delay:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await job.aborted.wait()
        return not job.aborted.is_set()

    def _open_stream(self, order: PrefillOrder) -> asyncio.Future[TransferResult] | None:
        """A KV stream for a long enough prompt (None: the KV goes in one WRITE after the prefill).
        Its deadline covers the prefill; finishing it sets the hand-off's own deadline."""
        if not (self._link.can_stream_to(order.decode_agent) and self._config.streams(len(order.prompt))):
            return None
        deadline = time.monotonic() + self._config.hold_lease_s
        return self._link.open_stream(order.decode_agent, order.request_id, order.attempt, deadline)

    async def _end_stream(self, order: PrefillOrder, stream: asyncio.Future[TransferResult] | None) -> None:
        """An unfinished stream never ends DONE: cancel it and wait until NIXL let go of every part,
        so that the answer's `baton-kv-idle` trailer holds."""
        if stream is not None:
            self._link.cancel(order.request_id, order.attempt)
            await stream

    async def _first_token(self, job: _RunningOrder) -> RequestOutput | None:
        """Prefill in the engine with the blocks held afterwards; None when aborted first."""
        order = job.order
        job.in_engine = True
        forward = job.forwarder
        stream = self._engine.generate(order.prompt, order.params, order.request_id,
                                       hold_for_s=self._config.hold_lease_s, checksum_hold=self._config.checksums,
                                       checksum_slices=self._link.head_slices(order.decode_agent),
                                       choice_samplings=order.choice_params, on_prefilled=forward)
        first = asyncio.ensure_future(_first_output(stream))
        aborted = asyncio.ensure_future(job.aborted.wait())
        try:
            await asyncio.wait(_futures(first, aborted), return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                await self._engine.abort(order.request_id)
            out = await first  # the held output if it won the race, else the ABORT output
        finally:
            aborted.cancel()
        if out.finish_reason is FinishReason.ABORT or not out.new_token_ids:
            return None
        return out

    async def _destination(self, job: _RunningOrder) -> PrefillOrder | None:
        """The order with the decode worker's blocks; None when aborted first or none came within the
        WRITE's deadline (the decode worker sends it as soon as it has reserved)."""
        if not job.placed.done():
            await _wait_first(job.placed, job.aborted, job.order.transfer_timeout_s)
        return job.placed.result() if job.placed.done() and not job.aborted.is_set() else None

    async def _transfer(self, job: _RunningOrder, held: HeldBlocks, first: RequestOutput, prefill_s: float,
                        stream: asyncio.Future[TransferResult] | None) -> TransferResult:
        """Post the WRITE (or the stream's last part) and wait until it is terminal, cancelling it if
        the job is aborted."""
        order = await self._destination(job)
        if order is None:
            state = TransferState.CANCELLED if job.aborted.is_set() else TransferState.FAILED
            return TransferResult(job.order.request_id, state, "no destination from the decode worker", 0.0, 0)
        first_block = order.num_cached_tokens // self._block_size
        end = first_block + len(order.remote_block_ids)
        local = held.block_ids[first_block:end]
        payload = HandoffPayload(checksums=_sent_checksums(held, first_block, end),
                                 first_token_id=first.new_token_ids[0],
                                 first_logprobs=first.logprobs[0] if first.logprobs else None,
                                 prefill_seconds=prefill_s,
                                 choice_first=tuple((t.token_id, t.logprobs) for t in first.choice_first))
        plan = TransferPlan.create(order.request_id, local, order.remote_block_ids, now=time.monotonic(),
                                   timeout_s=order.transfer_timeout_s, attempt=order.attempt, payload=payload)
        done: asyncio.Future[TransferResult]
        if stream is not None:  # its parts went during the prefill: time the rest, like a one-shot WRITE
            posted = time.monotonic()
            self._link.finish_stream(plan)
            done = asyncio.ensure_future(_timed_from(stream, posted))
        else:
            done = await self._link.send(order.decode_agent, plan)  # raises before posting: nothing to wait for
        aborted = asyncio.ensure_future(job.aborted.wait())
        try:
            await asyncio.wait(_futures(done, aborted), return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                self._link.cancel(order.request_id, order.attempt)
            return await done  # terminal: CANCELLED, or DONE if the WRITE won the race
        finally:
            aborted.cancel()


async def _wait_first(fut: asyncio.Future[Any], aborted: asyncio.Event, timeout_s: float) -> None:
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait(_futures(fut, waiter), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def _timed_from(stream: asyncio.Future[TransferResult], posted: float) -> TransferResult:
    result = await stream
    return dataclasses.replace(result, seconds=time.monotonic() - posted)


async def _first_output(stream: object) -> RequestOutput:
    """The first output of a hold request's stream (it finishes with it)."""
    agen = stream.__aiter__()  # type: ignore[attr-defined]
    try:
        return await agen.__anext__()  # type: ignore[no-any-return]
    finally:
        await agen.aclose()


def _futures(*futures: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
    """A set of differently typed futures for asyncio.wait."""
    return set(futures)


def _sent_checksums(held: HeldBlocks, first_block: int, end: int) -> tuple[int, ...] | None:
    """The checksums of the blocks sent, [first_block, end) of every head slice (rank-major, see
    engine.kv_integrity.head_slice_checksums; one slice unless the decode worker has another TP size)."""
    if held.checksums is None:
        return None
    n = len(held.block_ids)
    return tuple(s for base in range(0, len(held.checksums), n) for s in held.checksums[base + first_block:base + end])
