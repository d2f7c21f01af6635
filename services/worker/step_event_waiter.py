"""`StepEventWaiter`: a thread that waits for a streamed part's step event, so the KV link thread need not poll it.

A part of a KV stream waits for the CUDA event recorded after the step that fills its blocks
(engine/chunk_stream.py), i.e. for the GPU to finish that chunk while the engine thread launches the next.
Polling the event from the link thread every 50 us held the GIL 20,000 times a second beside the engine
thread, whose launches each need it back: a thread of tiny torch ops beside such a poll ran a third slower
(22.6 -> 30.0 ms; 27.0 at 200 us; lab/notes 2026-12-02 idle hand-off). Here one thread blocks in
`synchronize()`, which releases the GIL (the engine records the events with blocking sync, so the wait
sleeps instead of spinning a core), then wakes the link thread. It touches no NIXL state: every NIXL call
stays on the link thread, which also keeps querying the event at its own (slow) pace as a safety net.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class StepEvent(Protocol):
    """What a streamed part waits for (`torch.cuda.Event`)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class StepEventWaiter:
    def __init__(self, on_done: Callable[[], None]) -> None:
        """`on_done` (called on this thread after each watched event completed): wake the link thread."""
        self._on_done = on_done
        self._events: queue.SimpleQueue[StepEvent | None] = queue.SimpleQueue()
        self._watched: StepEvent | None = None  # the last event handed over (link thread only)
        self._thread: threading.Thread | None = None

    def watch(self, event: StepEvent) -> None:
        """Link thread: call `on_done` once `event` has completed. Repeated calls for one event wait once."""
        if event is self._watched:
            return
        self._watched = event
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="baton-kv-step-events", daemon=True)
            self._thread.start()
        self._events.put(event)

    def close(self) -> None:
        """The thread ends after the wait in progress (a daemon: a hung device cannot hold the process)."""
        self._events.put(None)

    def _run(self) -> None:
        while (event := self._events.get()) is not None:
            try:
                event.synchronize()
            except Exception:  # the link thread's own queries still see the event complete (or fail)
                log.exception("waiting for a streamed part's step event failed")
            self._on_done()
