"""What a profile times: one prefill step's or one decode step's shape, and the measured seconds.

Pure data shared by `baton profile` (services/profiler: builds the grid, times it on the engine) and
the fit that turns the times into a `WorkerProfile` (scheduler/calibration/profile_fit.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillPoint:
    """One prompt prefilled in one step: `new_tokens` computed over `cached_tokens` already in the KV."""

    new_tokens: int
    cached_tokens: int = 0

    @property
    def attention_tokens_sq(self) -> int:
        """The cost model's attention feature (scheduler/core/cost_model.py `prefill_s`)."""
        return self.new_tokens * (self.new_tokens + 2 * self.cached_tokens)


@dataclass(frozen=True)
class DecodePoint:
    """One decode step of `batch` sequences, each with `context_per_seq` tokens after the step."""

    batch: int
    context_per_seq: int

    @property
    def context_tokens(self) -> int:
        """Total context of the batch: what the cost model's per-context-token term multiplies."""
        return self.batch * self.context_per_seq


@dataclass(frozen=True)
class Measurements:
    """What was timed (point, median seconds), in grid order, and what did not fit the KV pool."""

    prefill: tuple[tuple[PrefillPoint, float], ...]
    decode: tuple[tuple[DecodePoint, float], ...]
    skipped: tuple[PrefillPoint | DecodePoint, ...] = ()
