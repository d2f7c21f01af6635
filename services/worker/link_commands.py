"""`LinkCommands`: what other threads ask of the KV link thread, run on it in the order asked.

A command may wait for a device event (a streamed part waits for the engine step that fills its blocks:
engine/chunk_stream.py). Everything behind a waiting command waits too, so a stream's DONE notice never
passes its parts. Checking an event is a non-blocking query, the link thread's only CUDA call; the wait
itself is a `StepEventWaiter`'s, which wakes the link thread when the event completes (no polling).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.step_event_waiter import StepEventWaiter


@dataclass(frozen=True)
class _Command:
    run: Callable[[], None]
    ready: torch.cuda.Event | None  # run once this has completed (None: at once)


class LinkCommands:
    def __init__(self, wake: Callable[[], None]) -> None:
        """`wake`: makes the link thread call `run_ready` soon (called once a pending event completed)."""
        self._queue: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._head: _Command | None = None  # taken off the queue, its event still pending
        self._waiter = StepEventWaiter(wake)

    def put(self, run: Callable[[], None], ready: torch.cuda.Event | None = None) -> None:
        """Any thread."""
        self._queue.put(_Command(run, ready))

    @property
    def waiting(self) -> bool:
        """A command waits for its event (the waiter wakes the link thread when it completes)."""
        return self._head is not None

    def close(self) -> None:
        self._waiter.close()

    def run_ready(self) -> None:
        """Link thread: run the queued commands in order, up to the first whose event is pending."""
        while True:
            if self._head is None:
                try:
                    self._head = self._queue.get_nowait()
                except queue.Empty:
                    return
            command = self._head
            if command.ready is not None and not command.ready.query():
                self._waiter.watch(command.ready)
                return
            self._head = None
            command.run()
