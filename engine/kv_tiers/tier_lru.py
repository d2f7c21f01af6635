"""Which block hashes one lower tier holds, in which slot, least recently used first (no torch).

A slot is an index into the tier's storage (a row of the host buffer, a file name on disk). Entries
pinned by an in-flight load are never chosen as victims: a promotion reads its slots after they were
looked up, possibly several engine steps later, so an eviction meanwhile would hand it someone else's
bytes.

Spare slots (the host tier's spill window): an evicted entry whose bytes still have to be read (written
to disk by the I/O thread) keeps its slot *retired* until `release`, and the new entry takes a spare slot
instead, so the engine thread never waits for (or copies for) the disk. With every spare retired the
victim's slot is reused at once and its bytes are dropped: a disk writer that falls behind loses blocks
instead of slowing the engine.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where `insert` put a hash, and what it pushed out to make room (None: a free slot was used)."""

    slot: int
    evicted_hash: int | None = None
    # The evicted entry's slot, retired with its bytes intact until `release` (None: no victim, or its slot
    # was reused for the new entry, every spare slot being retired).
    retired_slot: int | None = None


class TierLRU:
    """Hash -> slot for one tier, bounded by `capacity` slots. Not thread-safe: the engine loop owns it."""

    def __init__(self, capacity: int, spare: int = 0) -> None:
        """`capacity` entries at most, in `capacity + spare` slots (see the module docstring)."""
        if capacity < 0 or spare < 0:
            raise ValueError(f"capacity and spare must be >= 0, got {capacity}, {spare}")
        self.capacity = capacity
        self.num_slots = capacity + spare
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> slot, oldest first
        self._free = list(range(self.num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._retired: set[int] = set()  # slots whose bytes are still being read; back to _free on release
        self._pins: Counter[int] = Counter()  # hash -> loads reading it

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, block_hash: int) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: int) -> None:
        """Mark a hash as just used (a hit, or a re-demotion of a block already held here)."""
        self._slots.move_to_end(block_hash)

    def insert(self, block_hash: int, retire_victim: bool = False) -> Placement | None:
        """A slot for a new hash: a free one, else the least recently used unpinned entry's, which is
        retired (kept intact until `release`) when `retire_victim` and a spare slot is free.

        Returns None (changing nothing) when the tier is off or every entry is pinned."""
        if block_hash in self._slots:
            raise ValueError(f"hash {block_hash:#x} is already in this tier")
        if self.capacity == 0:
            return None
        if len(self._slots) < self.capacity:
            slot = self._free.pop()
            self._slots[block_hash] = slot
            return Placement(slot)
        victim = next((h for h in self._slots if h not in self._pins), None)  # `in`: no Counter __missing__
        if victim is None:
            return None
        victim_slot = self._slots.pop(victim)
        if retire_victim and self._free:
            self._retired.add(victim_slot)
            self._slots[block_hash] = self._free.pop()
            return Placement(self._slots[block_hash], victim, victim_slot)
        self._slots[block_hash] = victim_slot
        return Placement(victim_slot, victim)

    def take_spare(self) -> int | None:
        """A spare slot outside the LRU (retired until `release`): staging for bytes passing through, e.g.
        a block on its way to disk when there is no host tier. None when no spare slot is free."""
        if len(self._free) <= self.capacity - len(self._slots):  # the rest are owed to future entries
            return None
        slot = self._free.pop()
        self._retired.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """A retired slot's bytes have been read: it is free again."""
        self._retired.remove(slot)
        self._free.append(slot)

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    def remove(self, block_hash: int) -> None:
        """Forget a hash (its bytes turned out bad, or its write failed); its slot becomes free."""
        if self._pins[block_hash]:
            raise ValueError(f"hash {block_hash:#x} removed while a load reads it")
        self._free.append(self._slots.pop(block_hash))

    def pin(self, block_hash: int) -> None:
        if block_hash not in self._slots:
            raise KeyError(f"hash {block_hash:#x} is not in this tier")
        self._pins[block_hash] += 1

    def unpin(self, block_hash: int) -> None:
        if self._pins[block_hash] <= 0:
            raise ValueError(f"hash {block_hash:#x} unpinned more often than pinned")
        self._pins[block_hash] -= 1
        if not self._pins[block_hash]:
            del self._pins[block_hash]

    @property
    def num_pinned(self) -> int:
        """Entries some load still reads (0 once every load has finished or been cancelled)."""
        return len(self._pins)

    def is_pinned(self, block_hash: int) -> bool:
        return bool(self._pins[block_hash])
