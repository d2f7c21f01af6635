"""asyncio front of the engine: one background thread steps the engine; callers stream outputs.

Why a thread: a step is long, synchronous torch work; running it in the event loop would stall every
RPC handler. Commands (add, abort) cross into the engine thread through a queue and are applied only
between steps, so the engine itself stays single-threaded. Outputs cross back with
`loop.call_soon_threadsafe`, one asyncio.Queue per request.

Lifetimes: a request's stream ends with exactly one finished RequestOutput (stop/length/abort/error).
A consumer that stops iterating (cancellation, client gone) aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError
from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_sleep_s: float = 0.002,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        """`on_step` runs on the engine thread after every step that ran something: keep it cheap."""
        self.engine = engine
        self._on_step = on_step
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
                       request_id: str | None = None, *,
                       hold_for_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; raises the engine's typed error for bad input.

        `hold_for_s`: prefill only, see `LLMEngine.add_request`.
        """
        rid = request_id or f"req-{next(self._ids)}"
        stream = self._open(rid)
        await self.call(lambda: self.engine.add_request(rid, prompt_token_ids, params, hold_for_s=hold_for_s),
                        rid_on_error=rid)
        async for out in self._drain(rid, stream):
            yield out

    async def call(self, fn: Callable[[], Any], rid_on_error: str | None = None) -> Any:
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

        self._commands.put(run)
        self._wakeup.set()
        return await fut

    def open_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Subscribe to a request added by another route (e.g. `reserve_remote` + `commit_remote`)."""
        return self._drain(request_id, self._open(request_id))

    async def abort(self, request_id: str) -> bool:
        return bool(await self.call(lambda: self._abort_now(request_id)))

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
                self._wakeup.wait(0.05)
                self._wakeup.clear()
                continue
            try:
                self._step_once()
            except EngineError as e:
                log.exception("engine step failed")
                self._fail_all(e)
            except Exception as e:  # a bug must not leave streams hanging forever
                log.exception("engine step crashed")
                self._fail_all(e)
                time.sleep(self._idle_sleep_s)

    def _step_once(self) -> None:
        outputs = self.engine.step()
        stats = self.engine.last_step
        if self._on_step is not None and stats is not None:
            self._on_step(stats)
        if not outputs:
            if not self.engine.batcher.has_work():
                time.sleep(self._idle_sleep_s)  # nothing runnable (e.g. waiting for remote KV)
            return
        self.publish(outputs)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Deliver outputs to their streams (engine thread)."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

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


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
