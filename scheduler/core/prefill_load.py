"""How busy a worker's engine recently was with prefills: what a decoding request should expect.

A worker that prefills prompts locally (a `both` worker, or a decode worker taking a short prompt)
folds each prompt into its decode steps, so every sequence in its batch waits for the prefills of the
prompts that arrive during its life. Measured on the CPU policy runs (docs/benchmarks.md), a request's
TPOT on the batching worker rose by 26-62 ms per placement per second made there during its life, and
the predicted TPOT, priced from plain decode steps, was 30-70 ms short on average.

The scheduler cannot know future arrivals, so it takes the recent past as the forecast: an
exponentially weighted rate of the prefill compute (predicted seconds) placed on each worker. If a
fraction `share` of the engine's time goes to prefills, the decode steps get the rest, and a token
takes `step / (1 - share)`; so does every step of a wait for a decode slot.

Each prefill counts whole, its fixed part included: on the CPU policy runs a step carrying a prompt
cost about that prompt's whole prefill more than a decode step. Counting only the per-token part
read a share of 0.00-0.15 on the batching worker when ~35% of its time went to prefills, because
the online fit put nearly all of a short CPU prompt's cost in the fixed term.
"""

from __future__ import annotations

import math

# A share this high means prefills alone nearly saturate the engine: its queue grows and the TTFT
# prediction sees that; capping keeps one noisy estimate from pricing TPOT at infinity.
MAX_PREFILL_SHARE = 0.8


class DecayingRate:
    """Work per second, exponentially weighted over `time_constant_s` (a steady stream of `x`
    seconds of work every `1/r` seconds reads `x * r` once a few time constants have passed)."""

    def __init__(self, time_constant_s: float) -> None:
        if time_constant_s <= 0:
            raise ValueError("time_constant_s must be > 0")
        self._tau = time_constant_s
        self._value = 0.0
        self._at = -math.inf

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount / self._tau
        self._at = max(now, self._at)

    def value(self, now: float) -> float:
        if self._value == 0.0 or now <= self._at:
            return self._value
        return self._value * math.exp((self._at - now) / self._tau)


def decode_stretch(prefill_share: float, max_num_seqs: int | None) -> float:
    """How much longer decode steps take, wall clock, when `prefill_share` of the engine's time goes
    to prefills. A one-slot worker admits (and prefills) the next prompt only once its running
    sequence is done, so its decoding never shares the engine."""
    if max_num_seqs == 1:
        return 1.0
    return 1.0 / (1.0 - min(max(prefill_share, 0.0), MAX_PREFILL_SHARE))
