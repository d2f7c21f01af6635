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


def test_a_victim_is_retired_into_a_spare_slot_until_released() -> None:
    lru = TierLRU(1, spare=1)
    assert lru.insert(10) == Placement(0)
    assert lru.insert(11, retire_victim=True) == Placement(1, evicted_hash=10, retired_slot=0)
    assert lru.num_retired == 1 and lru.slot_of(11) == 1
    # the spare is taken: the next victim's slot is reused at once (its bytes dropped)
    assert lru.insert(12, retire_victim=True) == Placement(1, evicted_hash=11)
    lru.release(0)
    assert lru.num_retired == 0
    assert lru.insert(13, retire_victim=True) == Placement(0, evicted_hash=12, retired_slot=1)


def test_without_retire_a_victims_slot_is_reused_even_with_spares() -> None:
    lru = TierLRU(1, spare=2)
    lru.insert(10)
    assert lru.insert(11) == Placement(0, evicted_hash=10)


def test_take_spare_never_takes_a_slot_owed_to_the_lru() -> None:
    lru = TierLRU(2, spare=1)
    lru.insert(10)
    assert lru.take_spare() == 1  # one of the two free slots stays owed to the second entry
    assert lru.take_spare() is None
    assert lru.insert(11) == Placement(2)
    lru.release(1)
    assert lru.take_spare() == 1


def test_a_tier_of_spare_slots_only_holds_no_entries() -> None:
    lru = TierLRU(0, spare=2)
    assert lru.insert(10) is None and len(lru) == 0
    assert lru.take_spare() == 0 and lru.take_spare() == 1 and lru.take_spare() is None
