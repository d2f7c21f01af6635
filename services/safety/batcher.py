"""`EmbeddingBatcher`: texts from many concurrent callers go through the sentence encoder as one batch.

Why: under load the service judges hundreds of small texts a second (a 240-character output window
every 48 characters of every open stream, plus every prompt's sentences), and one encoder pass per
text pays the per-pass overhead each time (on a GPU nearly all of a small pass is overhead: kernel
launches, copies). A caller's texts are queued; a worker thread takes what is queued, waits up to
`max_wait_s` after the first entry for more (until `max_texts`), embeds all of it in one call and hands
each caller its rows. Under light load a check waits at most `max_wait_s` more; under heavy load
batches fill while the previous one runs, so nobody waits for the window.

Failure is per batch: when the encoder raises, every caller of that batch gets the error, and the
next batch is tried afresh. A caller that gave up (its future cancelled) or whose deadline passed
before its batch formed is dropped without being computed (`BatchDeadlineError`).

`EncoderBatching` keeps a batcher per `Lane` over one encoder: prompts, long prompts (many sentences,
seconds of CPU) and output windows each queue apart, so no kind waits behind another's batches (the
reason the service had separate pools before batching).

The deadline and lane of the gRPC call being served travel in context variables (`call_scope`): the
checker's tiers are synchronous code shared with the evaluator and tests, and threading them through
every signature to reach this one consumer would touch all of them.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
Embed = Callable[[list[str]], F32]

# When the gRPC call being served must be answered by (time.monotonic()); None: no deadline.
call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("call_deadline", default=None)
# The lane the service put the call in; None: chosen by size (EncoderBatching.embed).
call_lane: contextvars.ContextVar[Lane | None] = contextvars.ContextVar("call_lane", default=None)


class Batching(StrEnum):
    """Whether the service batches encoder passes across calls. AUTO: on for an encoder on a GPU, where
    a small pass is mostly overhead; off on a CPU, where a pass is FLOP-bound and batching measured
    no gain (worse tail latency on the loaded 2-core CI machine: docs/operations.md, "Safety capacity")."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def applies(self, device: str) -> bool:
        return self is Batching.ON or (self is Batching.AUTO and device.startswith("cuda"))


class BatchDeadlineError(TimeoutError):
    """The caller's deadline passed before its texts were embedded."""


@dataclass(frozen=True)
class BatchConfig:
    max_wait_s: float = 0.002  # how long the first text of a batch waits for company
    # A batch closes once it holds this many texts (one caller's are never split). None: one encoder
    # pass (`SentenceEncoder.batch_texts`: 32 on a CPU, where a bigger batch only adds waiting, 128 on a GPU).
    max_texts: int | None = None
    workers: int = 1           # batches in flight at once (threads calling the encoder)

    def __post_init__(self) -> None:
        if self.max_wait_s < 0 or (self.max_texts is not None and self.max_texts < 1) or self.workers < 1:
            raise ValueError(f"batching needs max_wait_s >= 0, max_texts >= 1, workers >= 1: {self}")


@dataclass
class _Entry:
    texts: list[str]
    deadline: float | None
    future: Future[F32] = field(default_factory=Future)


@contextmanager
def call_scope(lane: Lane, time_remaining_s: float | None) -> Iterator[None]:
    """Within the block, this thread's texts queue in `lane` and are dropped once `time_remaining_s` has passed."""
    deadline = call_deadline.set(None if time_remaining_s is None else time.monotonic() + time_remaining_s)
    named = call_lane.set(lane)
    try:
        yield
    finally:
        call_lane.reset(named)
        call_deadline.reset(deadline)


class EmbeddingBatcher:
    """Thread-safe; `embed(texts)` blocks until the batch holding `texts` is done."""

    def __init__(self, embed: Embed, config: BatchConfig, name: str = "safety-batch",
                 pass_texts: int = 32) -> None:
        """`pass_texts`: the encoder's texts a pass, the batch size when `config.max_texts` is None."""
        self._embed = embed
        self.config = config
        self._max_texts = config.max_texts or pass_texts
        self._queue: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(config.workers)]
        for worker in self._workers:
            worker.start()

    def submit(self, texts: list[str], deadline: float | None = None) -> Future[F32]:
        """A future of `texts`' embeddings; cancel it to withdraw texts not yet in a batch."""
        entry = _Entry(list(texts), deadline)
        self._queue.put(entry)
        return entry.future

    def embed(self, texts: list[str]) -> F32:
        """The embeddings of `texts`, batched with other callers'; raises BatchDeadlineError once the
        current call's deadline (`call_deadline`) passes, the encoder's error when its batch failed."""
        deadline = call_deadline.get()
        future = self.submit(texts, deadline)
        try:
            return future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError as e:
            future.cancel()
            raise BatchDeadlineError(f"no embeddings within the call's deadline ({len(texts)} texts)") from e

    def close(self) -> None:
        """Stop the workers after the batches already queued."""
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join()

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            self._run(batch)

    def _next_batch(self) -> list[_Entry] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch, count = [first], len(first.texts)
        close_at = time.monotonic() + self.config.max_wait_s
        while count < self._max_texts:
            try:
                entry = self._queue.get(timeout=max(0.0, close_at - time.monotonic()))
            except queue.Empty:
                break
            if entry is None:
                self._queue.put(None)  # the stop signal is this worker's, after this batch
                break
            batch.append(entry)
            count += len(entry.texts)
        return batch

    def _run(self, batch: list[_Entry]) -> None:
        now = time.monotonic()
        live = []
        for entry in batch:
            if not entry.future.set_running_or_notify_cancel():
                continue  # the caller withdrew
            if entry.deadline is not None and entry.deadline <= now:
                entry.future.set_exception(BatchDeadlineError("the call's deadline passed while its texts queued"))
                continue
            live.append(entry)
        if not live:
            return
        try:
            rows = self._embed([text for entry in live for text in entry.texts])
        except Exception as e:  # noqa: BLE001 -- handed to this batch's callers, who raise it
            for entry in live:
                entry.future.set_exception(e)
            return
        start = 0
        for entry in live:
            entry.future.set_result(rows[start:start + len(entry.texts)])
            start += len(entry.texts)


class Lane(StrEnum):
    """Which queue a check's texts wait in: each lane has its own batcher, so no kind of check waits
    behind another's batch (a CPU pass of 32 windows is ~1 s of CPU; a prompt must not queue behind it)."""

    INPUT = "input"            # prompts up to the long-text size
    LONG_INPUT = "long_input"  # prompts over it: one per pass
    OUTPUT = "output"          # output windows of open streams


class EncoderBatching:
    """A batcher per `Lane` over one encoder. The lane is the one the service named for the call
    (`call_scope`); outside a call, texts totalling over `long_chars` characters are LONG_INPUT, others INPUT."""

    def __init__(self, embed: Embed, interactive: BatchConfig, bulk: BatchConfig, long_chars: int,
                 pass_texts: int = 32) -> None:
        """`interactive`: the INPUT and OUTPUT lanes' batching; `bulk`: LONG_INPUT's."""
        self.lanes = {lane: EmbeddingBatcher(embed, bulk if lane is Lane.LONG_INPUT else interactive,
                                             f"safety-{lane.value}", pass_texts) for lane in Lane}
        self._long_chars = long_chars

    def embed(self, texts: list[str]) -> F32:
        lane = call_lane.get()
        if lane is None:
            lane = Lane.LONG_INPUT if sum(map(len, texts)) > self._long_chars else Lane.INPUT
        return self.lanes[lane].embed(texts)

    def close(self) -> None:
        for batcher in self.lanes.values():
            batcher.close()
