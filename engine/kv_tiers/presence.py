"""KV events with tiers: what the scheduler's prefix index learns of a worker that has tiers (no torch).

The scheduler routes a prompt to the worker that holds its prefix, wherever on that worker it lives, and
weighs the hit by the tier's load cost. So a worker reports, per hash, the fastest tier now holding it
(STORED with that tier) and only says EVICTED once no tier holds it any more. A GPU eviction whose block
was demoted to host is therefore a STORED(host), not an EVICTED: the next turn of a conversation still
finds the worker that holds its history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.block_manager import KVEvent, KVEventKind
from engine.kv_tiers.types import KVTier


class TieredKVEvents:
    def __init__(self, gpu_holds: Callable[[int], bool], lower_tier_of: Callable[[int], KVTier | None]) -> None:
        self._gpu_holds = gpu_holds
        self._lower_tier_of = lower_tier_of
        self._reported: dict[int, KVTier] = {}  # hash -> the tier last reported for it

    def translate(self, gpu_events: Iterable[KVEvent], lower_changes: Iterable[int]) -> list[KVEvent]:
        """One event per hash whose fastest tier changed since the last report, in first-touch order."""
        touched = dict.fromkeys([e.block_hash for e in gpu_events] + list(lower_changes))
        events: list[KVEvent] = []
        for block_hash in touched:
            tier = KVTier.GPU if self._gpu_holds(block_hash) else self._lower_tier_of(block_hash)
            previous = self._reported.get(block_hash)
            if tier == previous:
                continue
            if tier is None:
                assert previous is not None
                del self._reported[block_hash]
                events.append(KVEvent(KVEventKind.EVICTED, block_hash, previous))
            else:
                self._reported[block_hash] = tier
                events.append(KVEvent(KVEventKind.STORED, block_hash, tier))
        return events
