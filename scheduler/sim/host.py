"""How fast the machine under a simulated worker runs, over time.

A replay of a real run prices every step from profiles fitted over several runs. On a shared host
the engines' speed drifts during a run (other processes, the other workers on the same cores), and
near a worker's capacity the queue amplifies a few percent of drift into seconds of TTFT: the
one-slot worker of the CPU policy runs serves at ~1.0 of its capacity, so a stretch 15% slower
builds a queue the average speed never would (docs/benchmarks.md, scheduler policies, pass R).
`HostSpeed` replays that drift: a factor on every step's time per window of the run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostSpeed:
    """Step-time factors by window of `window_s` seconds from the replay's start (1.0: the fitted speed).
    Times before the first window or after the last take the nearest one; no factors: always 1.0."""

    window_s: float = 5.0
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if any(not f > 0 for f in self.factors):
            raise ValueError(f"speed factors must be positive, got {self.factors}")

    def at(self, t: float) -> float:
        if not self.factors:
            return 1.0
        index = int(t // self.window_s)
        return self.factors[min(max(index, 0), len(self.factors) - 1)]


STEADY = HostSpeed()
