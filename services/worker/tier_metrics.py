"""Prometheus metrics of a worker's KV tiers (host memory, disk), from the engine's TierStatsSnapshot.

The engine keeps cumulative counters; each refresh adds what changed since the previous one, so the
exported counters stay monotonic whatever the refresh rate. Load latencies are handed over once each.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.kv_tiers.tier_stats import LOAD_LATENCY_BUCKETS_S, TierStatsSnapshot

K = TypeVar("K", bound=StrEnum)


class TierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.capacity = Gauge("baton_kv_tier_capacity_blocks", "KV blocks a lower tier holds at most", ["tier"],
                              registry=r)
        self.occupied = Gauge("baton_kv_tier_occupied_blocks", "KV blocks held in a lower tier", ["tier"],
                              registry=r)
        self.pinned = Gauge("baton_kv_tier_pinned_blocks", "Lower-tier blocks read by a load in flight",
                            ["tier"], registry=r)
        self.loads_in_flight = Gauge("baton_kv_tier_loads_in_flight", "Requests waiting for their prefix to load",
                                     registry=r)
        self.hits = Counter("baton_kv_tier_hit_blocks", "Blocks promoted to the GPU pool, by source tier",
                            ["tier"], registry=r)
        self.loaded_bytes = Counter("baton_kv_tier_loaded_bytes", "Bytes promoted, by source tier", ["tier"],
                                    registry=r)
        self.demoted = Counter("baton_kv_tier_demoted_blocks", "Blocks written into a lower tier", ["tier"],
                               registry=r)
        self.demoted_bytes = Counter("baton_kv_tier_demoted_bytes", "Bytes written into a lower tier", ["tier"],
                                     registry=r)
        self.fallbacks = Counter("baton_kv_tier_fallback_blocks",
                                 "Lower-tier blocks recomputed instead of loaded, by reason", ["reason"], registry=r)
        self.skipped = Counter("baton_kv_tier_load_skipped",
                               "Prefix lookups that found a block but judged loading it slower than recomputing",
                               registry=r)
        self.spills_dropped = Counter("baton_kv_tier_spills_dropped",
                                      "Host-tier evictions dropped instead of written to the disk tier: the spill "
                                      "window was full (the disk writer is behind)", registry=r)
        self.load_seconds = Histogram("baton_kv_tier_load_seconds", "Promotion latency (start -> blocks landed)",
                                      buckets=LOAD_LATENCY_BUCKETS_S, registry=r)
        self._last: TierStatsSnapshot | None = None

    def refresh(self, snap: TierStatsSnapshot) -> None:
        for tier, n in snap.capacity_blocks.items():
            self.capacity.labels(tier.value).set(n)
            self.occupied.labels(tier.value).set(snap.occupied_blocks[tier])
            self.pinned.labels(tier.value).set(snap.pinned_blocks[tier])
        self.loads_in_flight.set(snap.loads_in_flight)
        last = self._last
        _add_deltas(self.hits, snap.hit_blocks, last.hit_blocks if last else {})
        _add_deltas(self.loaded_bytes, snap.loaded_bytes, last.loaded_bytes if last else {})
        _add_deltas(self.demoted, snap.demoted_blocks, last.demoted_blocks if last else {})
        _add_deltas(self.demoted_bytes, snap.demoted_bytes, last.demoted_bytes if last else {})
        _add_deltas(self.fallbacks, snap.fallbacks, last.fallbacks if last else {})
        _add_delta(self.skipped, snap.skipped_slower_than_recompute, last.skipped_slower_than_recompute if last else 0)
        _add_delta(self.spills_dropped, snap.spills_dropped, last.spills_dropped if last else 0)
        for seconds in snap.load_latency_s:
            self.load_seconds.observe(seconds)
        self._last = snap


def _add_deltas(counter: Counter, now: Mapping[K, int], before: Mapping[K, int]) -> None:
    """Bring a labelled counter from the `before` totals to the `now` totals."""
    for key, value in now.items():
        _add_delta(counter.labels(key.value), value, before.get(key, 0))


def _add_delta(counter: Counter, now: int, before: int) -> None:
    """Bring a counter from the `before` total to the `now` total."""
    if now > before:
        counter.inc(now - before)
