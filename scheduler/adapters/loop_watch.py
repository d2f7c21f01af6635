"""How late an asyncio event loop wakes up, and how long the garbage collector stops the process.

Every call a process serves waits while its one event loop is busy elsewhere. On the 4-GPU layout
runs gateways gave up on scheduler answers after 0.2 s several times a run, with the client's own
loop never more than 18 ms late (docs/benchmarks.md); whether the gateway or the scheduler was stuck
could not be told from their logs. `watch_loop` sleeps `interval_s` again and again and records how
much later than asked it woke (a lower bound on what any call waited); `GcPauses` times each
collection. Both log what crosses `warn_s`. The gateway and the scheduler both run them.

`watch_loop` also counts the CPU time of the loop's thread: the work every request and streamed token
queue on. Per run, that over the requests and tokens served is what a gateway (or scheduler) costs on
this host (lab/experiments/gateway_cost.py fits it from layout runs, and says why it is not yet
what `baton plan` simulates the gateway with); the process's CPU time would also count its other
threads (gRPC's, the tokenizer's), which do not hold the loop up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque
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
    process: str, lag: Histogram, config: LoopWatch = LoopWatch(), cpu: Counter | None = None,
    gc_pauses: GcPauses | None = None,
) -> None:
    """Observe the running loop's wake-up lag into `lag`, its thread's CPU seconds into `cpu`, and the
    garbage collections `gc_pauses` timed since the last tick, until cancelled."""
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
        if gc_pauses is not None:
            gc_pauses.flush()
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


class GcPauses:
    """Times every garbage collection of the process into `pauses` (and logs those over `warn_s`).

    The collector's callback only notes the duration: a collection runs inside whatever allocation set it
    off, which can be inside a metric's own update, under prometheus_client's lock. With several gateway
    processes (services/gateway/replicas.py) that is one process-wide, non-reentrant lock, and a callback
    observing the histogram itself deadlocked the process's thread on it: a 4xH200 run lost a gateway
    replica that way (docs/benchmarks.md). The durations wait in a deque (appends take no lock) until
    `flush()`, which `watch_loop` calls on every tick, outside any metric update.
    """

    def __init__(self, process: str, pauses: Histogram, warn_s: float = LoopWatch.warn_s) -> None:
        self.process = process
        self.pauses = pauses
        self.warn_s = warn_s
        self._started: float | None = None
        self._pending: deque[tuple[float, int, int]] = deque()  # seconds, generation, objects freed
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pending.append((time.perf_counter() - self._started, info.get("generation", -1),
                                  info.get("collected", 0)))
            self._started = None

    def flush(self) -> None:
        """Put the collections timed so far into the histogram (call outside any metric update)."""
        while self._pending:
            seconds, generation, collected = self._pending.popleft()
            self.pauses.observe(seconds)
            if seconds >= self.warn_s:
                log.warning("%s garbage collection of generation %d took %.0f ms (%d objects freed)",
                            self.process, generation, seconds * 1e3, collected)

    def stop(self) -> None:
        """No more timing; what was timed is flushed."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.flush()
