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

`EncoderBatching` keeps two batchers over one encoder: long texts (many sentences, seconds of CPU) on
their own worker, so short checks and output windows never queue behind them (the reason the service
had separate pools before batching).

The deadline of the gRPC call being served travels in a context variable (`call_deadline`): the
checker's tiers are synchronous code shared with the evaluator and tests, and threading a deadline
through every signature to reach this one consumer would touch all of them.
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

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
Embed = Callable[[list[str]], F32]

# When the gRPC call being served must be answered by (time.monotonic()); None: no deadline.
call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("call_deadline", default=None)


class BatchDeadlineError(TimeoutError):
    """The caller's deadline passed before its texts were embedded."""


@dataclass(frozen=True)
class BatchConfig:
    max_wait_s: float = 0.002  # how long the first text of a batch waits for company
    max_texts: int = 128       # a batch closes once it holds this many texts (one caller's are never split)
    workers: int = 1           # batches in flight at once (threads calling the encoder)

    def __post_init__(self) -> None:
        if self.max_wait_s < 0 or self.max_texts < 1 or self.workers < 1:
            raise ValueError(f"batching needs max_wait_s >= 0, max_texts >= 1, workers >= 1: {self}")


@dataclass
class _Entry:
    texts: list[str]
    deadline: float | None
    future: Future[F32] = field(default_factory=Future)


@contextmanager
def deadline_of_call(time_remaining_s: float | None) -> Iterator[None]:
    """Within the block, batchers drop this thread's texts once `time_remaining_s` has passed."""
    token = call_deadline.set(None if time_remaining_s is None else time.monotonic() + time_remaining_s)
    try:
        yield
    finally:
        call_deadline.reset(token)


class EmbeddingBatcher:
    """Thread-safe; `embed(texts)` blocks until the batch holding `texts` is done."""

    def __init__(self, embed: Embed, config: BatchConfig, name: str = "safety-batch") -> None:
        self._embed = embed
        self.config = config
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
        while count < self.config.max_texts:
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


class EncoderBatching:
    """Two batchers over one encoder: texts totalling over `long_chars` characters go to `bulk`."""

    def __init__(self, embed: Embed, interactive: BatchConfig, bulk: BatchConfig, long_chars: int) -> None:
        self.interactive = EmbeddingBatcher(embed, interactive, "safety-batch")
        self.bulk = EmbeddingBatcher(embed, bulk, "safety-bulk")
        self._long_chars = long_chars

    def embed(self, texts: list[str]) -> F32:
        long = sum(map(len, texts)) > self._long_chars
        return (self.bulk if long else self.interactive).embed(texts)

    def close(self) -> None:
        self.interactive.close()
        self.bulk.close()
