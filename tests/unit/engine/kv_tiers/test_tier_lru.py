"""TierLRU: one lower tier's hash -> slot bookkeeping, least recently used first, pins respected."""

from __future__ import annotations

import pytest

from engine.kv_tiers.tier_lru import Placement, TierLRU


def test_free_slots_are_used_before_any_eviction() -> None:
    lru = TierLRU(2)
    assert lru.insert(10) == Placement(0) and lru.insert(11) == Placement(1)
    assert len(lru) == 2 and lru.slot_of(10) == 0


def test_a_full_tier_evicts_the_least_recently_used_and_reuses_its_slot() -> None:
    lru = TierLRU(2)
    lru.insert(10)
    lru.insert(11)
    lru.touch(10)  # 11 is now the oldest
    assert lru.insert(12) == Placement(1, evicted_hash=11)
    assert 11 not in lru and lru.slot_of(12) == 1


def test_pinned_entries_are_never_evicted() -> None:
    lru = TierLRU(2)
    lru.insert(10)
    lru.insert(11)
    lru.pin(10)
    assert lru.insert(12) == Placement(1, evicted_hash=11)
    lru.pin(12)
    assert lru.insert(13) is None and 13 not in lru  # every entry is being read: nothing changes
    lru.unpin(10)
    assert lru.insert(13) == Placement(0, evicted_hash=10)


def test_pins_count_and_must_balance() -> None:
    lru = TierLRU(1)
    lru.insert(10)
    lru.pin(10)
    lru.pin(10)
    lru.unpin(10)
    assert lru.is_pinned(10) and lru.num_pinned == 1
    lru.unpin(10)
    assert lru.num_pinned == 0
    with pytest.raises(ValueError):
        lru.unpin(10)


def test_a_pinned_entry_cannot_be_removed_and_a_removed_slot_is_reused() -> None:
    lru = TierLRU(1)
    lru.insert(10)
    lru.pin(10)
    with pytest.raises(ValueError):
        lru.remove(10)
    lru.unpin(10)
    lru.remove(10)
    assert lru.insert(11) == Placement(0)


def test_a_zero_capacity_tier_holds_nothing() -> None:
    assert TierLRU(0).insert(1) is None
