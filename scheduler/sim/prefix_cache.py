"""A simulated worker's prefix cache: LRU sets of block hashes (the GPU pool and, optionally, the host-memory
KV tier below it) that report stored/evicted events as a real worker's do.

The simulator keeps cache capacity separate from the blocks live sequences reserve: a real block
manager shares one pool, but the routing question the simulator answers (does affinity pay off?)
only needs "recently computed prefixes stay for a while and eventually get evicted".

With a host tier (`host_capacity_blocks` > 0), a block evicted from the GPU set is demoted to the host
set (a STORED event with tier HOST, as engine/kv_tiers/presence.py reports it), and only a block that
leaves the host set too is EVICTED. A hit in the host set is promoted back to the GPU set; the worker
charges its load time (scheduler/sim/worker.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.types import KVEvent, KVEventKind, KVTier


@dataclass(frozen=True)
class CacheHit:
    blocks: int  # leading blocks held in any tier
    host_blocks: int = 0  # of those, the ones that had to come up from host memory


class SimPrefixCache:
    def __init__(self, capacity_blocks: int, host_capacity_blocks: int = 0) -> None:
        if capacity_blocks < 0 or host_capacity_blocks < 0:
            raise ValueError(f"capacities must be >= 0, got {capacity_blocks} and {host_capacity_blocks}")
        self._capacity = capacity_blocks
        self._host_capacity = host_capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._host: OrderedDict[int, None] = OrderedDict()
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def host_blocks(self) -> int:
        return len(self._host)

    def match(self, hashes: Sequence[int]) -> CacheHit:
        """Leading blocks held in the GPU or host set. A hit refreshes them, as a real prefix cache does on
        reuse; host hits are promoted to the GPU set."""
        count, promoted = 0, []
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
            elif block_hash in self._host:
                promoted.append(block_hash)
            else:
                break
            count += 1
        for block_hash in promoted:
            del self._host[block_hash]
        self.store(promoted)
        return CacheHit(count, len(promoted))

    def store(self, hashes: Sequence[int]) -> None:
        for block_hash in hashes:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            self._host.pop(block_hash, None)
            self._blocks[block_hash] = None
            self._events.append(KVEvent(KVEventKind.STORED, block_hash))
        while len(self._blocks) > self._capacity:
            evicted, _ = self._blocks.popitem(last=False)
            self._demote(evicted)

    def _demote(self, block_hash: int) -> None:
        if not self._host_capacity:
            self._events.append(KVEvent(KVEventKind.EVICTED, block_hash))
            return
        self._host[block_hash] = None
        self._events.append(KVEvent(KVEventKind.STORED, block_hash, KVTier.HOST))
        while len(self._host) > self._host_capacity:
            dropped, _ = self._host.popitem(last=False)
            self._events.append(KVEvent(KVEventKind.EVICTED, dropped, KVTier.HOST))

    def drain_events(self) -> list[KVEvent]:
        """Events since the last call, in order: what the next heartbeat carries."""
        events, self._events = self._events, []
        return events
