"""Per-expert load of an MoE model as Prometheus metrics, so routing imbalance is visible.

The engine counts the token slots routed to each expert of each MoE layer (`runner.expert_load()`,
`[layers, E]`, cumulative). Once per `interval_s` the engine thread reads them (one small copy from
the device) and exports:

- `baton_moe_expert_tokens_total{expert}`: slots routed to each expert, summed over the layers (E
  series: a label per layer would be E x layers, thousands for a real model).
- `baton_moe_expert_imbalance`: over the last interval, the most loaded expert's slots over the mean
  expert's, in the worst layer (1.0: perfectly even). Under expert parallelism the slowest rank sets
  the step time, and it is the one holding that layer's hot expert.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.layers.moe import expert_load_imbalance


class ExpertLoadMeter:
    def __init__(self, read_load: Callable[[], torch.Tensor | None], registry: CollectorRegistry,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._read_load = read_load
        self._interval_s = interval_s
        self._clock = clock
        self._next_read = 0.0
        self._last: torch.Tensor | None = None
        self.tokens = Counter("baton_moe_expert_tokens", "MoE token slots routed to each expert, summed over layers",
                              ["expert"], registry=registry)
        self.imbalance = Gauge("baton_moe_expert_imbalance",
                               "Most loaded expert / mean expert, last interval, worst MoE layer", registry=registry)

    def maybe_observe(self) -> None:
        """Engine thread, after a step: export what changed, at most once per interval."""
        now = self._clock()
        if now < self._next_read:
            return
        self._next_read = now + self._interval_s
        load = self._read_load()
        if load is None:
            return
        delta = load if self._last is None else load - self._last
        self._last = load
        per_expert = delta.sum(dim=0).tolist()
        for expert, count in enumerate(per_expert):
            if count:
                self.tokens.labels(str(expert)).inc(count)
        if sum(per_expert):
            self.imbalance.set(expert_load_imbalance(delta))

