"""`LinkCommands`: what other threads ask of the KV link thread, run on it in the order asked.

A command may wait for a device event (a streamed part waits for the engine step that fills its blocks:
engine/chunk_stream.py). Everything behind a waiting command waits too, so a stream's DONE notice never
passes its parts. Checking an event is a non-blocking query, the link thread's only CUDA call.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Command:
    run: Callable[[], None]
    ready: torch.cuda.Event | None  # run once this has completed (None: at once)


class LinkCommands:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._head: _Command | None = None  # taken off the queue, its event still pending

    def put(self, run: Callable[[], None], ready: torch.cuda.Event | None = None) -> None:
        """Any thread."""
        self._queue.put(_Command(run, ready))

    @property
    def waiting(self) -> bool:
        """A command waits for its event (the link thread then polls at its busy rate)."""
        return self._head is not None

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
                return
            self._head = None
            command.run()
