"""asyncio front of the engine: one background thread steps the engine; callers stream outputs.

Why a thread: a step is long, synchronous torch work; running it in the event loop would stall every
RPC handler. Commands (add, abort) cross into the engine thread through a queue and are applied only
between steps, so the engine itself stays single-threaded. Outputs cross back with
`loop.call_soon_threadsafe`, one asyncio.Queue per request.

Lifetimes: a request's stream ends with exactly one finished RequestOutput (stop/length/abort/error).
A consumer that stops iterating (cancellation, client gone) aborts the request, which frees its blocks.

The face is typed: every operation a worker needs is a method here (generate, the remote-prefill
reservation and commit, held blocks, status, KV events); whatever touches the engine's state runs
on the engine thread between steps, so callers never reach into `LLMEngine`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.batch import TokenLogprobs
from engine.block_manager import KVEvent
from engine.choices import ChoiceFork
from engine.chunk_stream import OnPrefilled
from engine.errors import EngineError, OutOfBlocksError
from engine.kv_tiers.tier_stats import TierStatsSnapshot
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestOutput
from engine.remote_commit import ABORTED_BEFORE_COMMIT, COMMITTED, CommitOutcome, CommitStatus, commit_failed
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from engine.step_stats import StepStats

log = logging.getLogger(__name__)
# How long the loop dozes when nothing can move without a command (which wakes it at once): the tick
# only checks the hold leases, whose expiry is the one change that needs no command.
_IDLE_DOZE_S = 0.05


@dataclass(frozen=True)
class EngineStatus:
    """A consistent snapshot of the engine, taken between two steps."""

    num_waiting: int
    num_running: int
    num_waiting_for_remote_kv: int
    num_pending_prefill_tokens: int  # prompt tokens queued or mid-prefill in this engine
    num_pending_prefill_requests: int  # the prompts those tokens belong to
    running_context_tokens: int  # summed context of the running sequences
    running_remaining_tokens: int  # tokens the running sequences may still generate
    free_blocks: int
    total_blocks: int
    held_blocks: int
    block_size: int
    max_num_seqs: int
    max_prefill_chunk: int  # longest slice of one prompt prefilled per step


@dataclass(frozen=True)
class Reservation:
    """Decode side: where a remote-prefill candidate went (`AsyncEngine.reserve_remote`)."""

    remote: bool  # blocks reserved for a remote prefill; else the request is queued locally
    block_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0  # prompt tokens this worker's prefix cache serves
    out_of_blocks: bool = False  # queued locally because no blocks were free to reserve


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_sleep_s: float = 0.002,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        """`on_step` runs on the engine thread after every step that ran something, before its outputs
        are published, with the step's served time (`StepStats.served_seconds`): keep it cheap."""
        self.engine = engine
        self._on_step = on_step
        self._since = time.perf_counter()  # the loop's last step end or wake from idle (served times)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._idle_sleep_s = idle_sleep_s
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

    # ---- public API (event loop side) -----------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, *, hold_for_s: float | None = None,
                       checksum_hold: bool = False, checksum_slices: int = 1,
                       choice_samplings: tuple[SamplingParams, ...] = (),
                       on_prefilled: OnPrefilled | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; raises the engine's typed error for bad input.

        `hold_for_s`, `checksum_hold`, `checksum_slices`, `choice_samplings`, `on_prefilled` (called on the
        engine thread): prefill only, see `LLMEngine.add_request`.
        """
        rid = request_id or f"req-{next(self._ids)}"
        stream = self._open(rid)
        await self._call(lambda: self.engine.add_request(rid, prompt_token_ids, params, hold_for_s=hold_for_s,
                                                         checksum_hold=checksum_hold, checksum_slices=checksum_slices,
                                                         choice_samplings=choice_samplings, on_prefilled=on_prefilled),
                         rid_on_error=rid)
        async for out in self._drain(rid, stream):
            yield out

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request whose stream was opened with `open_stream` (typed error for bad input)."""
        await self._call(lambda: self.engine.add_request(request_id, prompt_token_ids, params),
                         rid_on_error=request_id)

    async def reserve_remote(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                             wants_remote: Callable[[int], bool]) -> Reservation:
        """Reserve blocks for a remote prefill, or queue the request locally: when no blocks are free
        now, or when `wants_remote(num_cached_tokens)` (engine thread) declines given this worker's
        prefix cache. One engine-thread command, so the decision and the blocks cannot diverge."""
        def reserve() -> Reservation:
            engine = self.engine
            try:
                block_ids, cached = engine.reserve_remote(request_id, prompt_token_ids, params)
            except OutOfBlocksError:
                engine.add_request(request_id, prompt_token_ids, params)  # waits for blocks like any request
                return Reservation(remote=False, out_of_blocks=True)
            if wants_remote(cached):
                return Reservation(True, tuple(block_ids), cached)
            engine.abort(request_id)  # nothing was expected or asked: the blocks are ours to drop
            engine.add_request(request_id, prompt_token_ids, params)
            return Reservation(remote=False)

        return await self._call(reserve, rid_on_error=request_id)  # type: ignore[no-any-return]

    def commit_remote_threadsafe(self, request_id: str, first_token_id: int, first_logprobs: TokenLogprobs | None,
                                 verify: Callable[[], str],
                                 forks: Callable[[], tuple[ChoiceFork, ...]] = tuple,
                                 ) -> concurrent.futures.Future[CommitOutcome]:
        """The remote prefill's KV landed: run `verify` (e.g. checksums of the landed blocks) and, if it
        finds no problem, put the sequence into the batch with its first token, in one pass between
        steps. Callable from any thread (the KV link's, the moment the DONE notice arrives): queued for
        the next step boundary, never blocking the caller. The future holds the outcome: unless
        COMMITTED nothing is committed and the caller still owns (and must abort) the reservation;
        `verify`'s problem is REJECTED, a raise FAILED. A request aborted meanwhile is never committed
        (ABORTED).
        `forks` (n > 1), asked for on the engine thread at the commit (so a choice aborted until then
        is left out): sibling choices forked from the committed prompt; open their streams first."""
        done: concurrent.futures.Future[CommitOutcome] = concurrent.futures.Future()

        def commit() -> None:
            seq = self.engine.batcher.get(request_id)
            if seq is None or seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV:
                done.set_result(ABORTED_BEFORE_COMMIT)
                return
            try:
                problem = verify()
                if not problem:
                    self._publish(self.engine.commit_remote(request_id, first_token_id, first_logprobs, forks()))
            except Exception as e:  # noqa: BLE001 - handed to the caller as FAILED
                done.set_result(commit_failed(e))
            else:
                done.set_result(CommitOutcome(CommitStatus.REJECTED, problem) if problem else COMMITTED)

        self._submit(commit)
        return done

    def release_held(self, request_id: str) -> None:
        """Free a held prefill's blocks once its transfer is terminal (between steps; not awaited:
        nobody waits on it, and the next step frees them in time)."""
        self._submit(lambda: None if self.engine.release_held(request_id) else None)

    async def status(self) -> EngineStatus:
        def snapshot() -> EngineStatus:
            e, b, bm = self.engine, self.engine.batcher, self.engine.block_manager
            # A sequence waiting for its prefix to load from a lower KV tier is queued work too.
            return EngineStatus(b.num_waiting + b.num_loading_kv, b.num_running, b.num_waiting_for_remote_kv,
                                b.num_pending_prefill_tokens, b.num_pending_prefill_requests,
                                b.num_running_context_tokens, b.num_running_remaining_tokens,
                                bm.num_free_blocks,
                                bm.num_total_blocks, e.num_held_blocks, bm.block_size, e.config.batcher.max_num_seqs,
                                e.config.batcher.max_prefill_chunk)

        return await self._call(snapshot)  # type: ignore[no-any-return]

    async def drain_kv_events(self) -> list[KVEvent]:
        """KV events (blocks stored / evicted) since the last call, for the scheduler's prefix index."""
        return await self._call(self.engine.drain_kv_events)  # type: ignore[no-any-return]

    async def tier_stats(self) -> TierStatsSnapshot | None:
        """The KV tiers' counters and occupancy (None: this worker has no tiers)."""
        return await self._call(self.engine.tier_stats)  # type: ignore[no-any-return]

    async def _call(self, fn: Callable[[], Any], rid_on_error: str | None = None) -> Any:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller, never swallowed
                if rid_on_error is not None:
                    self._streams.pop(rid_on_error, None)
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._submit(run)
        return await fut

    def _submit(self, cmd: Callable[[], None]) -> None:
        self._commands.put(cmd)
        self._wakeup.set()

    def open_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Subscribe to a request added by another route (e.g. `reserve_remote` + `commit_remote`)."""
        return self._drain(request_id, self._open(request_id))

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call(lambda: self._abort_now(request_id)))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout_s)
        self.engine.shutdown()

    # ---- plumbing -------------------------------------------------------------------------------
    def _open(self, rid: str) -> _Stream:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        return stream

    async def _drain(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(lambda: None if self._abort_now(rid, notify=False) else None)
                self._wakeup.set()

    def _abort_now(self, rid: str, notify: bool = True) -> bool:
        existed = self.engine.abort(rid)
        stream = self._streams.pop(rid, None)
        if existed and notify and stream is not None:
            out = RequestOutput(request_id=rid, new_token_ids=(), new_text="", finish_reason=FinishReason.ABORT)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        return existed

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_commands()
            self.engine.release_expired_holds()
            if not self.engine.has_unfinished():
                self._doze(_IDLE_DOZE_S)
                continue
            try:
                self._step_once()
            except EngineError as e:
                log.exception("engine step failed")
                self._fail_all(e)
                self._since = time.perf_counter()
            except Exception as e:  # a bug must not leave streams hanging forever
                log.exception("engine step crashed")
                self._fail_all(e)
                time.sleep(self._idle_sleep_s)
                self._since = time.perf_counter()

    def _step_once(self) -> None:
        outputs = self.engine.step()
        stats = self.engine.last_step
        if stats is not None:
            self._report(stats)
        if not outputs:
            idle = stats is None or not self.engine.batcher.has_work()
            if idle and not self.engine.batcher.num_in_flight:  # batches in flight: the next round moves them
                # Nothing runnable. A load from a lower KV tier ends without a command: poll for it.
                # Sequences waiting for remote KV move only on a command (the commit of landed KV),
                # which wakes the thread at once: ticking meanwhile only took CPU (and the GIL) from
                # the rest of the worker during every remote prefill.
                self._doze(self._idle_sleep_s if self.engine.batcher.has_work() else _IDLE_DOZE_S)
            return
        self._publish(outputs)

    def _report(self, stats: StepStats) -> None:
        """Hand `on_step` the step with its served time: the loop's wall time since its previous step
        (or its wake from idle), so a busy loop's samples add up to its period, the client's token gap,
        and a dozing loop's idle time is in none of them."""
        now = time.perf_counter()
        served, self._since = now - self._since, now
        if self._on_step is not None:
            self._on_step(replace(stats, served_seconds=served))

    def _doze(self, seconds: float) -> None:
        """Idle until a command arrives or `seconds` pass; idle time is no step's served time."""
        self._wakeup.wait(seconds)
        self._wakeup.clear()
        self._since = time.perf_counter()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Deliver outputs to their streams (engine thread): one event-loop wake-up per loop and step,
        not one per request (at 128 running sequences that was 128 self-pipe writes and callbacks a
        step, and a busy decode worker's event loop then delayed every hand-off's commit)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | BaseException],
                                                             RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _fail_all(self, error: Exception) -> None:
        """A step crashed: fail every stream. Requests waiting for remote KV are left to their owner,
        which aborts them once no WRITE can land in their blocks (freeing them here could hand blocks
        to a new request while a prefill worker still writes into them)."""
        for rid in list(self._streams):
            seq = self.engine.batcher.get(rid)
            if seq is None or seq.status is not SequenceStatus.WAITING_FOR_REMOTE_KV:
                self.engine.abort(rid)
            stream = self._streams.pop(rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)


def _deliver(batch: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for q, out in batch:
        q.put_nowait(out)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
