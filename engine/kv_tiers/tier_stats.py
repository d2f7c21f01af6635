"""Per-tier counters the worker exports as Prometheus metrics (no torch).

Mutated only on the engine thread; the worker reads a `TierStatsSnapshot` (a frozen copy) between
steps, so a scrape never sees a half-updated set.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.kv_tiers.types import KVTier, LoadFailure

# Load latency buckets (seconds): a host hit of a few blocks is ~0.1 ms on a GPU, a disk hit of a long
# history tens of ms.
LOAD_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class TierStatsSnapshot:
    capacity_blocks: dict[KVTier, int]
    occupied_blocks: dict[KVTier, int]
    pinned_blocks: dict[KVTier, int]
    hit_blocks: dict[KVTier, int]  # blocks promoted from each tier
    loaded_bytes: dict[KVTier, int]
    demoted_blocks: dict[KVTier, int]  # blocks written into each tier
    demoted_bytes: dict[KVTier, int]
    fallbacks: dict[LoadFailure, int]  # blocks recomputed instead of loaded, by reason
    skipped_slower_than_recompute: int  # lookups that found a block but judged the load too slow
    loads_in_flight: int
    load_latency_s: tuple[float, ...]  # every finished promotion's latency since the last snapshot
    spills_dropped: int = 0  # host evictions not written to disk: the spill window was full (disk behind)


@dataclass
class TierStats:
    hit_blocks: Counter[KVTier] = field(default_factory=Counter)
    loaded_bytes: Counter[KVTier] = field(default_factory=Counter)
    demoted_blocks: Counter[KVTier] = field(default_factory=Counter)
    demoted_bytes: Counter[KVTier] = field(default_factory=Counter)
    fallbacks: Counter[LoadFailure] = field(default_factory=Counter)
    skipped_slower_than_recompute: int = 0
    spills_dropped: int = 0
    pending_latencies: list[float] = field(default_factory=list)

    def record_demotion(self, tier: KVTier, num_bytes: int) -> None:
        self.demoted_blocks[tier] += 1
        self.demoted_bytes[tier] += num_bytes

    def record_load(self, tier: KVTier, num_blocks: int, num_bytes: int) -> None:
        self.hit_blocks[tier] += num_blocks
        self.loaded_bytes[tier] += num_bytes

    def take_latencies(self) -> tuple[float, ...]:
        taken, self.pending_latencies = tuple(self.pending_latencies), []
        return taken
