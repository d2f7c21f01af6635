"""Arrival processes: when each session (a single request, or a conversation's first turn) starts.

The whole schedule is drawn up front from the seed, so a run is reproducible and its timing does not
depend on how fast the server answers (an open loop: a slow server does not slow the offered load).
`--max-concurrency C` then caps the requests in flight on top of any schedule; "fixed concurrency C"
is `rate = inf` with that cap (a closed loop: a new request as soon as one finishes).

Inter-arrival gaps are gamma distributed with shape = burstiness and mean = 1/rate, as in vLLM's
benchmark_serving: burstiness 1 is a Poisson process, < 1 is burstier (more variance), > 1 is more
regular; the mean rate is the same for all.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass


class ArrivalProcess(ABC):
    """Start offsets (seconds from the run's start, non-decreasing) for `n` sessions."""

    @abstractmethod
    def schedule(self, n: int, rng: random.Random) -> list[float]: ...

    @abstractmethod
    def describe(self) -> dict: ...


@dataclass(frozen=True)
class GammaArrivals(ArrivalProcess):
    rate: float  # sessions per second, finite and > 0
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson

    def __post_init__(self) -> None:
        if not (0 < self.rate < math.inf) or self.burstiness <= 0:
            raise ValueError(f"need 0 < rate < inf and burstiness > 0, got {self.rate}, {self.burstiness}")

    def schedule(self, n: int, rng: random.Random) -> list[float]:
        scale = 1.0 / (self.rate * self.burstiness)  # mean gap = shape * scale = 1 / rate
        t, out = 0.0, []
        for _ in range(n):
            t += rng.gammavariate(self.burstiness, scale)
            out.append(t)
        return out

    def describe(self) -> dict:
        kind = "poisson" if self.burstiness == 1.0 else "gamma"
        return {"process": kind, "rate": self.rate, "burstiness": self.burstiness}


@dataclass(frozen=True)
class ImmediateArrivals(ArrivalProcess):
    """Everything at t=0 (rate = inf): with --max-concurrency this is a fixed-concurrency closed loop."""

    def schedule(self, n: int, rng: random.Random) -> list[float]:
        return [0.0] * n

    def describe(self) -> dict:
        return {"process": "immediate", "rate": "inf"}


def make_arrivals(rate: float, burstiness: float = 1.0) -> ArrivalProcess:
    return ImmediateArrivals() if math.isinf(rate) else GammaArrivals(rate, burstiness)


def parse_rate(text: str) -> float:
    """`"4"`, `"0.5"` or `"inf"`; argparse type for --request-rate."""
    value = float(text)
    if value <= 0 or math.isnan(value):
        raise ValueError(f"request rate must be > 0 or inf, got {text!r}")
    return value
