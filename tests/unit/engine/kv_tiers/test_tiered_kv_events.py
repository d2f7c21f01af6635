"""TieredKVEvents: the scheduler hears the fastest tier holding each hash, EVICTED only once none does."""

from __future__ import annotations

from engine.block_manager import KVEvent, KVEventKind
from engine.kv_tiers.presence import TieredKVEvents
from engine.kv_tiers.types import KVTier


def test_a_gpu_eviction_demoted_to_host_reads_as_stored_in_host() -> None:
    gpu: set[int] = {7}
    lower: dict[int, KVTier] = {}
    events = TieredKVEvents(gpu.__contains__, lower.get)
    assert events.translate([KVEvent(KVEventKind.STORED, 7)], []) == [KVEvent(KVEventKind.STORED, 7, KVTier.GPU)]
    gpu.clear()
    lower[7] = KVTier.HOST
    assert events.translate([KVEvent(KVEventKind.EVICTED, 7)], [7]) == [KVEvent(KVEventKind.STORED, 7, KVTier.HOST)]
    lower[7] = KVTier.DISK
    assert events.translate([], [7]) == [KVEvent(KVEventKind.STORED, 7, KVTier.DISK)]
    del lower[7]
    assert events.translate([], [7]) == [KVEvent(KVEventKind.EVICTED, 7, KVTier.DISK)]


def test_changes_below_a_gpu_resident_hash_are_not_reported() -> None:
    gpu = {7}
    lower = {7: KVTier.HOST}
    events = TieredKVEvents(gpu.__contains__, lower.get)
    events.translate([KVEvent(KVEventKind.STORED, 7)], [])
    del lower[7]
    assert events.translate([], [7]) == []  # the GPU still holds it: nothing the scheduler must know
