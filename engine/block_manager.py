"""The paged KV block pool: integer block ids, ref counts, prefix caching by chained block hashes.

No torch: the block manager only decides *which* block ids hold which tokens; the model runner owns
the tensor (`engine/kv_cache.py`) and kvtransfer moves block contents between workers.

Prefix caching. A full block's hash is its chained hash (`tokenization.block_hashes`): it names the whole
prefix up to and including the block, and the gateway computes the same hashes so the scheduler can route
by prefix. A block's hash is registered (and a STORED event emitted) only once its
tokens are *computed* (`mark_computed`), so a request never reuses a block another request is still
prefilling. A block whose ref count drops to 0 but carries a registered hash is not wiped: it goes to
an LRU of cached-free blocks that a later prompt with the same prefix can revive. Cached-free blocks
are handed out for new content (EVICTED event) only when the plain free list is empty, oldest first.

KV tiers. With a `BlockDemoter` (engine/kv_tiers), a block that becomes cached-free is offered to it
(its KV is final: it may start copying it below the GPU in the background), and an evicted block's hash
and id are handed to it *before* the block is returned for new content, so its bytes are kept below the
GPU (host memory, disk) while they are still intact: the hash is demoted, not dropped. The EVICTED event then only says
that the GPU pool lost it; the engine turns that into a tier-carrying event for the scheduler.

Invariants (checked by the tests):
- every block id is in exactly one of: in use (ref count > 0), the plain free list, the cached-free LRU;
- a block in the plain free list carries no hash; a cached-free block is the registered block of its hash;
- within one block table, the blocks carrying a hash form a prefix of the table;
- a failed allocation (OutOfBlocksError) changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from engine.errors import OutOfBlocksError
from tokenization.block_hashes import block_hashes, hash_block

# What the scheduler's prefix index learns from this worker (sent with heartbeats); the engine and the
# scheduler share the vocabulary from the ground floor.
from tokenization.kv_blocks import KVEvent, KVEventKind


class BlockDemoter(Protocol):
    """Receives each cached-free block, and each evicted one before it is reused (engine/kv_tiers/store.py)."""

    def offer(self, block_id: int, block_hash: int) -> None:
        """The block just became cached-free: its bytes are final until it is evicted (`demote`)."""

    def demote(self, block_id: int, block_hash: int) -> None:
        """Copy (or start copying, ordered before any later write into the block) its bytes below the GPU."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates, shares and frees KV blocks. Not thread-safe: the engine loop owns it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 demoter: BlockDemoter | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size  # tokens per block
        self.enable_prefix_caching = enable_prefix_caching  # False: no hashing, no reuse, no events
        self._ref_counts = [0] * num_blocks  # block tables holding each block
        # Content hash of each computed full block (None: not full, not computed, or caching off). A block
        # may carry a hash that is registered to another block (two requests computed the same prefix).
        self._hashes: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # registered hash -> the block serving it (in use or cached-free)
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash: handed out first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0, registered hash; oldest first
        self._events: list[KVEvent] = []  # not yet drained
        self._demoter = demoter  # None: an evicted block's content is dropped

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free plus cached-free (evictable) blocks."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is registered (reusable by a prompt with that prefix), in use or not."""
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold `num_tokens` slots."""
        return _cdiv(num_tokens, self.block_size)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate_for_prompt(self, token_ids: Sequence[int],
                            num_extra_slots: int = 0) -> tuple[list[int], int]:
        """A new block table for `token_ids` (+ `num_extra_slots` empty slots), reusing cached prefix blocks.

        Returns (block ids, number of leading tokens whose KV is already cached). The cached count is a
        whole number of blocks and at most `len(token_ids) - 1`: the last prompt token is always computed
        (its logits give the first output token). The block holding that last token is never a cache
        hit, even when its whole content is cached, so recomputing it never writes into a shared block.
        Used both for local prefill and for blocks a remote prefill worker will write into.
        Raises OutOfBlocksError, changing nothing, when the pool is too small.
        """
        hits = self._prefix_hits(token_ids)
        num_new = self.blocks_for(len(token_ids) + num_extra_slots) - len(hits)
        revived = sum(1 for b in hits if self._ref_counts[b] == 0)  # hits that leave the cached-free LRU
        available = self.num_free_blocks - revived
        if num_new > available:
            raise OutOfBlocksError(f"{len(token_ids)} tokens need {num_new} new blocks; {available} free")
        for b in hits:  # take the hits before allocating, so none of them is evicted below
            if self._ref_counts[b] == 0:
                del self._cached_free[b]
            self._ref_counts[b] += 1
        return hits + [self._take_block() for _ in range(num_new)], len(hits) * self.block_size

    def append_slots(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Grow `block_ids` in place until it holds `num_tokens` slots (decode); returns the added ids.

        Raises OutOfBlocksError, changing nothing, when the pool is too small.
        """
        num_new = self.blocks_for(num_tokens) - len(block_ids)
        if num_new <= 0:
            return []
        if num_new > self.num_free_blocks:
            raise OutOfBlocksError(f"need {num_new} more blocks; {self.num_free_blocks} free")
        new = [self._take_block() for _ in range(num_new)]
        block_ids.extend(new)
        return new

    def share(self, block_ids: Sequence[int]) -> list[int]:
        """A new table holding one more reference to each of `block_ids` (all in use): a forked choice
        shares its parent's prompt blocks; `free` drops the reference like any other."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} shared while not in use")
        for b in block_ids:
            self._ref_counts[b] += 1
        return list(block_ids)

    def copy_on_write(self, block_ids: list[int], index: int) -> tuple[int, int] | None:
        """Make block `index` of a table its own before the table's owner writes into it.

        A block other tables also reference (a forked prompt's partly filled last block) is replaced in
        `block_ids` by a fresh block; returns (source, destination) for the runner to copy the KV, or
        None when the block was not shared. Raises OutOfBlocksError, changing nothing, when no block is free.
        """
        old = block_ids[index]
        if self._ref_counts[old] <= 1:
            return None
        if not self.num_free_blocks:
            raise OutOfBlocksError("no free block for a copy-on-write")
        new = self._take_block()
        self._ref_counts[old] -= 1  # still > 0: the other tables keep it
        block_ids[index] = new
        return old, new

    def mark_computed(self, block_ids: Sequence[int], token_ids: Sequence[int],
                      num_computed_tokens: int) -> None:
        """Record that the first `num_computed_tokens` of a table's tokens have their KV written.

        Registers the hash of every newly full computed block (STORED event) so later prompts can reuse
        it. Called by the batcher after each step, and after a remote prefill's KV has landed.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_ids))
        first = num_full  # hashed blocks form a prefix of the table: find its end from the back
        while first > 0 and self._hashes[block_ids[first - 1]] is None:
            first -= 1
        parent = self._hashes[block_ids[first - 1]] if first else None
        for i in range(first, num_full):
            block = block_ids[i]
            parent = hash_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            self._hashes[block] = parent
            if parent not in self._cached:
                self._register(parent, block)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block of a table; unreferenced blocks become allocatable.

        Freed in reverse so a chain's tail enters the LRU first and is evicted before its head (a
        prefix's first blocks are the most likely to be shared again).
        """
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed while not in use")
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._release(b)

    def is_cached(self, block_hash: int) -> bool:
        """Whether a block of the pool (in use or cached-free) serves `block_hash`."""
        return block_hash in self._cached

    def drain_events(self) -> list[KVEvent]:
        """The KV events since the last drain, in order."""
        events, self._events = self._events, []
        return events

    # ---- internals ------------------------------------------------------------------------------
    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Registered blocks serving the longest cached prefix, excluding the last token's block."""
        if not self.enable_prefix_caching or not token_ids:
            return []
        max_hits = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        for h in block_hashes(token_ids[:max_hits * self.block_size], self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _take_block(self) -> int:
        """One unreferenced block for new content: plain free first, else evict the oldest cached-free."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)
            evicted = self._hashes[block]
            assert evicted is not None and self._cached[evicted] == block
            if self._demoter is not None:
                self._demoter.demote(block, evicted)
            del self._cached[evicted]
            self._hashes[block] = None
            self._events.append(KVEvent(KVEventKind.EVICTED, evicted))
        self._ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        """A block's last reference is gone: keep its content reusable if it carries a hash."""
        h = self._hashes[block]
        if h is not None and h not in self._cached:
            self._register(h, block)  # its twin was evicted meanwhile: this copy now serves the hash
        if h is not None and self._cached[h] == block:
            self._cached_free[block] = None
            if self._demoter is not None:
                self._demoter.offer(block, h)
        else:
            self._hashes[block] = None
            self._free.append(block)

    def _register(self, h: int, block: int) -> None:
        self._cached[h] = block
        self._events.append(KVEvent(KVEventKind.STORED, h))
