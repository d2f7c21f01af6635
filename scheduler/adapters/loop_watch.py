"""How late an asyncio event loop wakes up, and how long the garbage collector stops the process.

Every call a process serves waits while its one event loop is busy elsewhere. On the 4-GPU layout
runs gateways gave up on scheduler answers after 0.2 s several times a run, with the client's own
loop never more than 18 ms late (docs/benchmarks.md); whether the gateway or the scheduler was stuck
could not be told from their logs. `watch_loop` sleeps `interval_s` again and again and records how
much later than asked it woke (a lower bound on what any call waited); `time_gc_pauses` records each
collection. Both log what crosses `warn_s`. The gateway and the scheduler both run them.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Histogram

log = logging.getLogger(__name__)

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class LoopWatch:
    interval_s: float = 0.05
    warn_s: float = 0.1

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.warn_s <= 0:
            raise ValueError("interval_s and warn_s must be positive")


async def watch_loop(process: str, lag: Histogram, config: LoopWatch = LoopWatch()) -> None:
    """Observe the running loop's wake-up lag into `lag` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + config.interval_s
        await asyncio.sleep(config.interval_s)
        late = max(loop.time() - due, 0.0)
        lag.observe(late)
        if late >= config.warn_s:
            log.warning("%s event loop woke %.0f ms late: every call it serves waited as long", process, late * 1e3)


def time_gc_pauses(process: str, pauses: Histogram, warn_s: float = LoopWatch.warn_s) -> Callable[[], None]:
    """Observe every garbage collection's duration into `pauses`; returns the function that stops it."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
            return
        if not started:
            return
        seconds = time.perf_counter() - started.pop()
        pauses.observe(seconds)
        if seconds >= warn_s:
            log.warning("%s garbage collection of generation %d took %.0f ms (%d objects freed)",
                        process, info.get("generation", -1), seconds * 1e3, info.get("collected", 0))

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)
