"""How late an asyncio event loop wakes up, and how long the garbage collector stops the process.

Every call a process serves waits while its one event loop is busy elsewhere. On the 4-GPU layout
runs gateways gave up on scheduler answers after 0.2 s several times a run, with the client's own
loop never more than 18 ms late (docs/benchmarks.md); whether the gateway or the scheduler was stuck
could not be told from their logs. `watch_loop` sleeps `interval_s` again and again and records how
much later than asked it woke (a lower bound on what any call waited); `time_gc_pauses` records each
collection. Both log what crosses `warn_s`. The gateway and the scheduler both run them.

`watch_loop` also counts the CPU time of the loop's thread: the work every request and streamed token
queue on. Per run, that over the requests and tokens served is what a gateway (or scheduler) costs on
this host (loadtest/experiments/gateway_cost.py fits it from layout runs, and says why it is not yet
what `baton plan` simulates the gateway with); the process's CPU time would also count its other
threads (gRPC's, the tokenizer's), which do not hold the loop up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

log = logging.getLogger(__name__)

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class LoopWatch:
    interval_s: float = 0.05
    warn_s: float = 0.1

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.warn_s <= 0:
            raise ValueError("interval_s and warn_s must be positive")


async def watch_loop(
    process: str, lag: Histogram, config: LoopWatch = LoopWatch(), cpu: Counter | None = None
) -> None:
    """Observe the running loop's wake-up lag into `lag`, and its thread's CPU seconds into `cpu`,
    until cancelled."""
    loop = asyncio.get_running_loop()
    cpu_seen = time.thread_time()  # this task runs on the loop's thread: its CPU time is the loop's
    while True:
        due = loop.time() + config.interval_s
        await asyncio.sleep(config.interval_s)
        late = max(loop.time() - due, 0.0)
        lag.observe(late)
        if cpu is not None:
            cpu_now = time.thread_time()
            cpu.inc(cpu_now - cpu_seen)
            cpu_seen = cpu_now
        if late >= config.warn_s:
            log.warning("%s event loop woke %.0f ms late: every call it serves waited as long", process, late * 1e3)


# The young-generation collection threshold the scheduler and the gateway run with (CPython's default is
# 700 allocations). Both allocate many short-lived objects that reference counting frees, so the
# collector mostly finds nothing, and at the default it ran inside ~1% of routing decisions (~0.3 ms
# each, ~1.8 ms when it took generation 1 along: most of the slowest 1%, docs/benchmarks.md, decision
# latency); the gateway's loop paused for it 700-960 times in a 25-s layout run at 40 req/s, 11-19% of
# its CPU. Ten times the threshold makes young collections, and the full ones that every hundredth
# triggers, ten times rarer. `settle_gc` also freezes what the process allocated while starting
# (modules, tokenizers, profiles), which never becomes garbage and each full collection re-scanned.
YOUNG_GC_THRESHOLD = 7000


def quiet_gc(threshold: int = YOUNG_GC_THRESHOLD) -> tuple[int, int, int]:
    """Collect the young generation every `threshold` net allocations (process-wide; the older
    generations' ratios stay CPython's). Returns the thresholds before, for `gc.set_threshold`."""
    previous = gc.get_threshold()
    gc.set_threshold(threshold, previous[1], previous[2])
    return previous


def settle_gc() -> None:
    """For a service that has finished starting: `quiet_gc`, and its startup objects frozen out of
    every later collection (`gc.freeze`)."""
    gc.collect()
    gc.freeze()
    quiet_gc()


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
