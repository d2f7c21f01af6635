"""The event-loop and garbage-collection watchdogs the gateway and the scheduler run."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from scheduler.adapters.loop_watch import (
    LAG_BUCKETS_S,
    YOUNG_GC_THRESHOLD,
    GcPauses,
    LoopWatch,
    quiet_gc,
    settle_gc,
    watch_loop,
)


def histogram(name: str) -> Histogram:
    return Histogram(name, name, buckets=LAG_BUCKETS_S, registry=CollectorRegistry())


def observed(h: Histogram) -> tuple[float, float]:
    """(count, sum) of what the histogram observed."""
    samples = {s.name: s.value for metric in h.collect() for s in metric.samples}
    return samples[f"{h._name}_count"], samples[f"{h._name}_sum"]  # noqa: SLF001 - the metric's own name


async def test_a_blocked_loop_is_measured_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    lag = histogram("lag")
    watch = asyncio.create_task(watch_loop("test", lag, LoopWatch(interval_s=0.01, warn_s=0.1)))
    await asyncio.sleep(0.05)  # a few quiet wake-ups first
    with caplog.at_level(logging.WARNING, logger="scheduler.adapters.loop_watch"):
        time.sleep(0.3)  # blocks the loop, as a slow synchronous handler would
        await asyncio.sleep(0.05)
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch
    count, total = observed(lag)
    assert count >= 3
    assert 0.25 <= total < 1.0  # the one block, plus the quiet wake-ups' few ms
    assert any("test event loop woke" in r.getMessage() for r in caplog.records)


async def test_the_loop_threads_cpu_time_is_counted_and_time_blocked_idle_is_not() -> None:
    cpu = Counter("cpu", "cpu", registry=CollectorRegistry())
    watch = asyncio.create_task(watch_loop("test", histogram("lag"), LoopWatch(interval_s=0.01), cpu=cpu))
    await asyncio.sleep(0.02)
    # 0.2 s of work on the loop's thread, by its own CPU clock: on a contended machine 0.2 s of wall
    # time can be far less CPU (0.07 s, niced beside the policy runs).
    busy_until = time.thread_time() + 0.2
    while time.thread_time() < busy_until:
        pass
    time.sleep(0.2)  # 0.2 s blocked without using the CPU
    await asyncio.sleep(0.03)
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch
    counted = cpu.collect()[0].samples[0].value
    assert 0.15 <= counted < 0.35


def test_garbage_collections_are_timed_until_stopped() -> None:
    pauses = histogram("pauses")
    timer = GcPauses("test", pauses)
    gc.collect()
    # The collector's callback only notes the pause: the histogram is touched at the next flush, never
    # from inside a collection (which may run under a metric's own lock).
    assert observed(pauses)[0] == 0
    timer.flush()
    count, _ = observed(pauses)
    assert count >= 1
    timer.stop()
    gc.collect()
    timer.flush()
    assert observed(pauses)[0] == count


async def test_the_loop_watch_flushes_the_timed_collections() -> None:
    pauses = histogram("pauses")
    timer = GcPauses("test", pauses)
    try:
        gc.collect()
        watch = asyncio.create_task(watch_loop("test", histogram("lag"), LoopWatch(interval_s=0.01), gc_pauses=timer))
        await asyncio.sleep(0.05)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
        assert observed(pauses)[0] >= 1
    finally:
        timer.stop()


def test_a_collection_inside_a_multiprocess_metric_update_does_not_deadlock(tmp_path: Path) -> None:
    """prometheus_client's multiprocess mode (several gateway processes) guards every value with one
    non-reentrant lock; a collection that starts inside an update must not observe a metric itself."""
    program = textwrap.dedent("""
        import gc
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from scheduler.adapters.loop_watch import GcPauses
        r = CollectorRegistry()
        pauses = Histogram("pauses", "p", registry=r)
        counter = Counter("c", "c", ["n"], registry=r)
        timer = GcPauses("test", pauses)
        gc.set_threshold(1)  # a collection at nearly every allocation
        for n in range(2000):  # a new child allocates under the lock (a callback observing there deadlocked)
            counter.labels(str(n)).inc()
        gc.set_threshold(700)
        timer.stop()
        print("done")
    """)
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=20)
    assert done.stdout.strip() == "done", done.stderr


def test_a_non_positive_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoopWatch(interval_s=0.0)


def test_quiet_gc_raises_only_the_young_threshold_and_gives_back_the_old_ones() -> None:
    before = gc.get_threshold()
    try:
        assert quiet_gc(7000) == before
        assert gc.get_threshold() == (7000, before[1], before[2])
    finally:
        gc.set_threshold(*before)


def test_settle_gc_freezes_what_the_process_holds_and_quiets_the_young_generation() -> None:
    before = gc.get_threshold()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == YOUNG_GC_THRESHOLD
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
