"""A simulated worker's prefix cache: an LRU set of block hashes that reports stored/evicted events.

The simulator keeps cache capacity separate from the blocks live sequences reserve: a real block
manager shares one pool, but the routing question the simulator answers (does affinity pay off?)
only needs "recently computed prefixes stay for a while and eventually get evicted".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from scheduler.types import KVEvent, KVEventKind


class SimPrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks held; a hit refreshes them, as a real prefix cache does on reuse."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            count += 1
        return count

    def store(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            self._blocks[block_hash] = None
            self._events.append(KVEvent(KVEventKind.STORED, block_hash))
        while len(self._blocks) > self._capacity:
            evicted, _ = self._blocks.popitem(last=False)
            self._events.append(KVEvent(KVEventKind.EVICTED, evicted))

    def drain_events(self) -> list[KVEvent]:
        """Events since the last call, in order: what the next heartbeat carries."""
        events, self._events = self._events, []
        return events
