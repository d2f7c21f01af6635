"""Behaviour of the KV block pool: counts, prefix reuse, events, LRU eviction, atomic failure."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.block_manager import BlockManager, KVEvent, KVEventKind
from engine.errors import OutOfBlocksError
from tokenization.block_hashes import block_hashes, hash_block

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def computed(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """Allocate a table for `token_ids` and mark every token computed (a finished prefill)."""
    block_ids, _ = bm.allocate_for_prompt(token_ids)
    bm.mark_computed(block_ids, token_ids, len(token_ids))
    return block_ids


def stored(*hashes: int) -> list[KVEvent]:
    return [KVEvent(KVEventKind.STORED, h) for h in hashes]


# ---- hashes ---------------------------------------------------------------------------------------
def test_block_hash_wire_format_is_blake2b_of_parent_and_uint32_tokens() -> None:
    expected_first = int.from_bytes(
        hashlib.blake2b((0).to_bytes(8, "little") + struct.pack("<4I", 1, 2, 3, 4), digest_size=8).digest(),
        "little")
    expected_second = int.from_bytes(
        hashlib.blake2b(expected_first.to_bytes(8, "little") + struct.pack("<4I", 5, 6, 7, 8),
                        digest_size=8).digest(), "little")
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS) == [expected_first, expected_second]


def test_block_hash_is_pinned_so_other_processes_agree() -> None:
    assert hash_block(None, [1, 2, 3, 4]) == block_hashes([1, 2, 3, 4], BS)[0] == 0x09222804E3E39BA2


def test_block_hashes_cover_full_blocks_only() -> None:
    assert len(block_hashes(toks(11), BS)) == 2
    assert block_hashes(toks(3), BS) == []


def test_block_hash_depends_on_the_whole_prefix() -> None:
    a = block_hashes([1, 1, 1, 1, 9, 9, 9, 9], BS)
    b = block_hashes([2, 2, 2, 2, 9, 9, 9, 9], BS)
    assert a[1] != b[1]
    assert all(0 <= h < 2**64 for h in a + b)


# ---- allocation and counts ------------------------------------------------------------------------
def test_allocate_takes_ceil_blocks_and_free_returns_them() -> None:
    bm = BlockManager(8, BS)
    block_ids, cached = bm.allocate_for_prompt(toks(9))
    assert (len(block_ids), cached, bm.num_free_blocks) == (3, 0, 5)
    bm.free(block_ids)
    assert bm.num_free_blocks == 8
    assert [bm.ref_count(b) for b in block_ids] == [0, 0, 0]


def test_extra_slots_are_allocated_with_the_prompt() -> None:
    bm = BlockManager(8, BS)
    block_ids, _ = bm.allocate_for_prompt(toks(8), num_extra_slots=1)
    assert len(block_ids) == 3


def test_append_slots_grows_the_table_in_place_only_across_a_block_boundary() -> None:
    bm = BlockManager(8, BS)
    table, _ = bm.allocate_for_prompt(toks(4))
    assert bm.append_slots(table, 4) == []
    added = bm.append_slots(table, 5)
    assert len(added) == 1 and table[-1] == added[0] and len(table) == 2
    assert bm.num_free_blocks == 6


def test_failed_allocation_changes_nothing() -> None:
    bm = BlockManager(4, BS)
    table, _ = bm.allocate_for_prompt(toks(12))
    with pytest.raises(OutOfBlocksError):
        bm.allocate_for_prompt(toks(8, start=100))
    with pytest.raises(OutOfBlocksError):
        bm.append_slots(table, 20)
    assert bm.num_free_blocks == 1 and len(table) == 3
    assert bm.can_allocate(1) and not bm.can_allocate(2)


def test_failed_allocation_does_not_revive_cached_hits() -> None:
    bm = BlockManager(3, BS)
    prefix = computed(bm, toks(8))
    bm.free(prefix)
    bm.drain_events()
    with pytest.raises(OutOfBlocksError):  # 2 cached hits + 2 new blocks, but only 1 block is left
        bm.allocate_for_prompt(toks(16))
    assert bm.num_free_blocks == 3 and bm.drain_events() == []
    again, cached = bm.allocate_for_prompt(toks(9))
    assert again[:2] == prefix and cached == 8


def test_double_free_is_refused_before_any_change() -> None:
    bm = BlockManager(4, BS)
    table, _ = bm.allocate_for_prompt(toks(8))
    bm.free(table[:1])
    with pytest.raises(ValueError):
        bm.free(table)
    assert bm.ref_count(table[1]) == 1


# ---- prefix caching -------------------------------------------------------------------------------
def test_computed_prefix_blocks_are_shared_by_a_later_prompt() -> None:
    bm = BlockManager(16, BS)
    first = computed(bm, toks(10))
    second, cached = bm.allocate_for_prompt(toks(8) + [77, 78, 79])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert cached == 8
    assert [bm.ref_count(b) for b in first] == [2, 2, 1]


def test_blocks_still_being_prefilled_are_not_shared() -> None:
    bm = BlockManager(16, BS)
    first, _ = bm.allocate_for_prompt(toks(12))
    bm.mark_computed(first, toks(12), 5)  # only the first block is computed so far
    second, cached = bm.allocate_for_prompt(toks(12))
    assert cached == 4 and second[0] == first[0] and set(second[1:]).isdisjoint(first)


def test_the_block_of_the_last_prompt_token_is_never_a_hit() -> None:
    bm = BlockManager(16, BS)
    first = computed(bm, toks(8))
    second, cached = bm.allocate_for_prompt(toks(8))
    assert cached == 4  # the last token must run to produce logits: its whole block is recomputed
    assert second[0] == first[0] and second[1] != first[1]


def test_freed_prefix_is_revived_from_the_cache_without_events() -> None:
    bm = BlockManager(8, BS)
    first = computed(bm, toks(9))
    bm.free(first)
    bm.drain_events()
    assert bm.num_free_blocks == 8
    second, cached = bm.allocate_for_prompt(toks(9))
    assert second[:2] == first[:2] and cached == 8
    assert bm.drain_events() == []


def test_mark_computed_emits_one_stored_event_per_new_full_block() -> None:
    bm = BlockManager(8, BS)
    tokens = toks(10)
    table, _ = bm.allocate_for_prompt(tokens)
    bm.mark_computed(table, tokens, 5)
    bm.mark_computed(table, tokens, 10)
    bm.mark_computed(table, tokens, 10)
    assert bm.drain_events() == stored(*block_hashes(tokens, BS))
    assert bm.drain_events() == []


def test_decode_tokens_that_fill_a_block_become_cacheable() -> None:
    bm = BlockManager(8, BS)
    tokens = toks(3)
    table, _ = bm.allocate_for_prompt(tokens, num_extra_slots=1)
    bm.mark_computed(table, tokens, 3)
    assert bm.drain_events() == []
    tokens.append(50)  # the sampled token, computed by the next decode step
    bm.mark_computed(table, tokens, 4)
    assert bm.drain_events() == stored(hash_block(None, tokens))


def test_same_prefix_computed_twice_is_stored_once_and_all_blocks_come_back() -> None:
    bm = BlockManager(8, BS)
    a, _ = bm.allocate_for_prompt(toks(5))
    b, _ = bm.allocate_for_prompt(toks(5))
    bm.mark_computed(a, toks(5), 5)
    bm.mark_computed(b, toks(5), 5)
    assert bm.drain_events() == stored(hash_block(None, toks(4)))
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 1


# ---- eviction -------------------------------------------------------------------------------------
def test_plain_free_blocks_are_used_before_cached_ones() -> None:
    bm = BlockManager(4, BS)
    cached_table = computed(bm, toks(4))
    bm.free(cached_table)
    bm.drain_events()
    fresh, _ = bm.allocate_for_prompt(toks(12, start=100))
    assert cached_table[0] not in fresh and bm.drain_events() == []


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS)
    old = computed(bm, toks(4, start=0))
    new = computed(bm, toks(4, start=10))
    bm.free(old)
    bm.free(new)
    filler, _ = bm.allocate_for_prompt(toks(8, start=100))  # takes the 2 plain free blocks
    bm.drain_events()
    evicting, _ = bm.allocate_for_prompt([200])
    assert evicting == old
    assert bm.drain_events() == [KVEvent(KVEventKind.EVICTED, hash_block(None, toks(4)))]
    bm.free(evicting)
    survivor, cached = bm.allocate_for_prompt(toks(4, start=10) + [1])
    assert cached == 4 and survivor[0] == new[0]  # the newer one survived
    bm.free(survivor)
    assert bm.allocate_for_prompt(toks(4) + [1])[1] == 0  # the older one is gone
    assert filler  # the filler table stays alive until here


def test_a_chain_is_evicted_tail_first() -> None:
    bm = BlockManager(3, BS)
    chain = computed(bm, toks(12))
    bm.free(chain)
    bm.drain_events()
    taken, _ = bm.allocate_for_prompt([500])
    assert taken == [chain[2]]
    assert bm.drain_events() == [KVEvent(KVEventKind.EVICTED, block_hashes(toks(12), BS)[2])]
    bm.free(taken)
    assert bm.allocate_for_prompt(toks(9))[1] == 8  # the head of the prefix is still cached


def test_revived_hit_moves_out_of_the_eviction_order() -> None:
    bm = BlockManager(2, BS)
    shared = computed(bm, toks(4))
    bm.free(shared)
    table, cached = bm.allocate_for_prompt(toks(5))  # revives the cached block, takes the plain one
    assert cached == 4 and table[0] == shared[0]
    with pytest.raises(OutOfBlocksError):
        bm.allocate_for_prompt([900])


def test_without_prefix_caching_nothing_is_shared_or_reported() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    first = computed(bm, toks(9))
    second, cached = bm.allocate_for_prompt(toks(9))
    assert cached == 0 and set(first).isdisjoint(second)
    bm.free(first)
    bm.free(second)
    assert bm.drain_events() == [] and bm.num_free_blocks == 8 and bm.num_cached_blocks == 0


# ---- the demoter (KV tiers) ----------------------------------------------------------------------
class RecordingDemoter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def offer(self, block_id: int, block_hash: int) -> None:
        self.calls.append(("offer", block_id, block_hash))

    def demote(self, block_id: int, block_hash: int) -> None:
        self.calls.append(("demote", block_id, block_hash))


def test_a_block_becoming_cached_free_is_offered_and_its_eviction_demoted() -> None:
    demoter = RecordingDemoter()
    bm = BlockManager(num_blocks=2, block_size=BS, demoter=demoter)
    tokens = toks(2 * BS)
    table = computed(bm, tokens)
    h0, h1 = block_hashes(tokens, BS)
    bm.free(table)  # the tail first, as eviction order has it
    assert demoter.calls == [("offer", table[1], h1), ("offer", table[0], h0)]
    bm.allocate_for_prompt([999])  # evicts the oldest cached-free block
    assert demoter.calls[-1] == ("demote", table[1], h1)


def test_a_block_without_a_registered_hash_is_not_offered() -> None:
    demoter = RecordingDemoter()
    bm = BlockManager(num_blocks=4, block_size=BS, demoter=demoter)
    table, _ = bm.allocate_for_prompt(toks(BS + 1))  # never computed: no hash
    bm.free(table)
    assert demoter.calls == []
