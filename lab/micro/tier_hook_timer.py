"""Engine-thread time spent inside the KV tier store's hooks, counted with `time.perf_counter_ns`.

`HookTimer(engine)` wraps the tier store's hook methods and the engine's `step` on the instances (the
block manager, the batcher and the engine call them through the instance), so it measures any version of
engine/kv_tiers/store.py without changing it. Nested hooks (a hook calling another) count once. Read it
from the engine thread's side only between phases (`take()`): the counters are plain ints.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine

# Every engine-thread entry point of the store, old and new names (absent ones are skipped).
TIER_HOOKS = ("demote", "offer", "between_steps", "reap_writes", "start_load", "poll", "cancel")


@dataclass(frozen=True)
class HookTimes:
    steps: int
    step_ms: float  # engine steps' wall time, tier hooks included
    tier_ms: float  # engine-thread time inside the tier hooks
    tier_ms_by_hook: dict[str, float]
    calls_by_hook: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "step_ms": self.step_ms, "tier_ms": self.tier_ms,
                "tier_ms_per_step": self.tier_ms / self.steps if self.steps else 0.0,
                "tier_share_of_step_time": self.tier_ms / self.step_ms if self.step_ms else 0.0,
                "tier_ms_by_hook": self.tier_ms_by_hook, "calls_by_hook": self.calls_by_hook}


class HookTimer:
    def __init__(self, engine: LLMEngine) -> None:
        self._ns: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()
        self._depth = 0
        self._steps = 0
        self._step_ns = 0
        store = engine.tiers
        if store is not None:
            for name in TIER_HOOKS:
                method = getattr(store, name, None)
                if method is not None:
                    setattr(store, name, self._timed(name, method))
        step = engine.step

        @functools.wraps(step)
        def timed_step():  # type: ignore[no-untyped-def]
            start = time.perf_counter_ns()
            try:
                return step()
            finally:
                self._steps += 1
                self._step_ns += time.perf_counter_ns() - start

        engine.step = timed_step  # type: ignore[method-assign]

    def _timed(self, name: str, method: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(method)
        def timed(*args: object, **kwargs: object) -> object:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self._ns[name] += time.perf_counter_ns() - start
                self._calls[name] += 1
                self._depth -= 1

        return timed

    def take(self) -> HookTimes:
        """The times since the last `take` (or since the timer was made), then starts counting afresh."""
        ns, calls = dict(self._ns), dict(self._calls)
        times = HookTimes(self._steps, self._step_ns / 1e6, sum(ns.values()) / 1e6,
                          {k: v / 1e6 for k, v in sorted(ns.items())}, dict(sorted(calls.items())))
        self._ns.clear()
        self._calls.clear()
        self._steps = self._step_ns = 0
        return times
