"""The clock the adapter hands the core: the core never reads time itself (see core/scheduler.py).

Monotonic, not wall time: liveness compares receipt times, and a wall clock stepped by NTP would
expire every worker at once (or keep dead ones alive). Tests pass a `ManualClock` to move time
past a heartbeat deadline without sleeping through it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a clock that never goes backwards; only differences are meaningful."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds})")
        self._now += seconds
