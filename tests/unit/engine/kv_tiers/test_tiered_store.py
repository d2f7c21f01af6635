"""TieredKVStore on a plain CPU KV pool: demotion, promotion, spills, faults and cancellation.

The pool is [num_blocks, layers=2, 2, block_size=4, kv_heads=1, head_dim=8] float32: 512 B a block.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from engine.kv_tiers.load_policy import LoadCostModel
from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.types import KVTier, LoadFailure, LoadResult, LoadState, TierConfig
from tokenization.block_hashes import block_hashes

BLOCK = 512
BS = 4
TOKENS = list(range(100, 100 + 4 * BS + 1))  # 4 full blocks + the last token's block
HASHES = block_hashes(TOKENS, BS)


def make_store(tmp_path: Path, host_blocks: int, disk_blocks: int = 0) -> TieredKVStore:
    kv = torch.randn(16, 2, 2, BS, 1, 8, generator=torch.Generator().manual_seed(0))
    config = TierConfig(host_bytes=host_blocks * BLOCK, disk_dir=str(tmp_path / "kv") if disk_blocks else None,
                        disk_bytes=disk_blocks * BLOCK, min_load_speedup=0.0)
    return TieredKVStore(config, kv, BS)


def demote_prefix(store: TieredKVStore, n: int) -> list[torch.Tensor]:
    """Demote the first n blocks of TOKENS from GPU blocks 0..n-1; returns their bytes."""
    originals = [store.kv_cache[i].clone() for i in range(n)]
    for i in range(n):
        store.demote(i, HASHES[i])
    store.flush()
    return originals


def load(store: TieredKVStore, into: list[int], num_cached: int = 0) -> LoadResult:
    """Start a load into GPU blocks `into` (the table of TOKENS) and poll it to the end."""
    assert store.start_load("r", TOKENS, into, num_cached) > 0
    return wait_done(store, "r")


def wait_done(store: TieredKVStore, request_id: str) -> LoadResult:
    deadline = time.monotonic() + 30  # generous: disk reads run on the I/O thread of a busy machine
    while time.monotonic() < deadline:
        result = store.poll(request_id)
        if result.state is LoadState.DONE:
            return result
        time.sleep(0.005)
    raise AssertionError("the load never finished")


def test_a_demoted_block_is_promoted_back_bit_exact(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    originals = demote_prefix(store, 2)
    table = [8, 9, 10, 11, 12]
    result = load(store, table)
    assert result == LoadResult(LoadState.DONE, 2 * BS)
    assert torch.equal(store.kv_cache[8], originals[0]) and torch.equal(store.kv_cache[9], originals[1])
    snap = store.snapshot()
    assert snap.hit_blocks == {KVTier.HOST: 2} and snap.pinned_blocks == {KVTier.HOST: 0, KVTier.DISK: 0}


def test_loading_starts_after_the_cached_prefix_and_stops_at_the_first_miss(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    store.demote(1, HASHES[1])
    store.demote(3, HASHES[3])  # block 2 is nowhere: block 3 cannot be used
    assert store.start_load("r", TOKENS, [0, 5, 6, 7, 8], num_cached=BS) == BS
    assert store.poll("r").num_loaded_tokens == BS
    assert store.start_load("s", TOKENS, [0, 5, 6, 7, 8], num_cached=0) == 0  # block 0 is a miss


def test_the_last_tokens_block_is_never_loaded(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    demote_prefix(store, 2)
    assert store.start_load("r", TOKENS[:2 * BS], [8, 9], 0) == BS  # block 1 holds the last token


def test_a_full_host_tier_spills_its_oldest_block_to_disk(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=1, disk_blocks=4)
    originals = demote_prefix(store, 2)
    assert store.lower_tier_of(HASHES[0]) is KVTier.DISK and store.lower_tier_of(HASHES[1]) is KVTier.HOST
    result = load(store, [8, 9, 10, 11, 12])
    assert result.num_loaded_tokens == 2 * BS
    assert torch.equal(store.kv_cache[8], originals[0]) and torch.equal(store.kv_cache[9], originals[1])
    assert store.snapshot().hit_blocks == {KVTier.DISK: 1, KVTier.HOST: 1}


def test_a_full_disk_tier_drops_its_oldest_file(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=2)
    demote_prefix(store, 3)
    assert store.lower_tier_of(HASHES[0]) is None
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == sorted(
        store.disk_files.path(h).name for h in HASHES[1:3])  # type: ignore[union-attr]


def test_a_flipped_byte_on_disk_is_a_bad_checksum_and_the_block_is_recomputed(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    demote_prefix(store, 2)
    path = store.disk_files.path(HASHES[1])  # type: ignore[union-attr]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    result = load(store, [8, 9, 10, 11, 12])
    assert result == LoadResult(LoadState.DONE, BS, (LoadFailure.BAD_CHECKSUM,))  # block 0 still loads
    store.flush()
    assert store.lower_tier_of(HASHES[1]) is None and not path.exists()  # a bad file is not offered again
    assert store.snapshot().fallbacks == {LoadFailure.BAD_CHECKSUM: 1}


def test_a_missing_file_falls_back_to_recompute(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    demote_prefix(store, 1)
    store.disk_files.path(HASHES[0]).unlink()  # type: ignore[union-attr]
    assert load(store, [8, 9, 10, 11, 12]) == LoadResult(LoadState.DONE, 0, (LoadFailure.MISSING_FILE,))
    assert store.snapshot().fallbacks == {LoadFailure.MISSING_FILE: 1}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make a write fail with ENOSPC")
def test_a_full_disk_drops_the_block_and_counts_it(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    os.symlink("/dev/full", store.disk_files.path(HASHES[0]))  # type: ignore[union-attr]  # writes get ENOSPC
    store.demote(0, HASHES[0])
    store.flush()
    assert store.lower_tier_of(HASHES[0]) is None
    assert store.snapshot().fallbacks == {LoadFailure.DISK_FULL: 1}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make a write fail with ENOSPC")
def test_a_load_queued_behind_a_failed_write_fails_as_disk_full(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    os.symlink("/dev/full", store.disk_files.path(HASHES[0]))  # type: ignore[union-attr]
    store.demote(0, HASHES[0])  # not reaped: the load is planned while the write is still recorded
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == BS
    assert wait_done(store, "r") == LoadResult(LoadState.DONE, 0, (LoadFailure.DISK_FULL,))
    assert store.lower_tier_of(HASHES[0]) is None and store.snapshot().fallbacks == {LoadFailure.DISK_FULL: 1}


def test_cancel_releases_every_pin_and_forgets_the_load(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=1, disk_blocks=4)
    demote_prefix(store, 2)
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == 2 * BS
    assert store.snapshot().pinned_blocks == {KVTier.HOST: 1, KVTier.DISK: 1}
    assert store.cancel("r") and not store.cancel("r")
    snap = store.snapshot()
    assert snap.pinned_blocks == {KVTier.HOST: 0, KVTier.DISK: 0} and snap.loads_in_flight == 0


def test_entries_pinned_by_a_load_survive_later_demotions(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=1)
    original = demote_prefix(store, 1)[0]
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == BS  # pins HASHES[0]
    store.demote(5, HASHES[2])  # the only host slot is pinned: this block is not kept
    assert store.lower_tier_of(HASHES[2]) is None and store.lower_tier_of(HASHES[0]) is KVTier.HOST
    assert store.poll("r").num_loaded_tokens == BS and torch.equal(store.kv_cache[8], original)


def test_an_earlier_runs_files_are_not_trusted(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "00000000000000aa.kv").write_bytes(b"old")
    make_store(tmp_path, host_blocks=0, disk_blocks=2)
    assert list((tmp_path / "kv").iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_of_dtypes_numpy_lacks_round_trip_through_disk(tmp_path: Path, dtype: torch.dtype) -> None:
    kv = torch.randn(16, 2, 2, BS, 1, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    block = kv[0].numel() * kv.element_size()
    store = TieredKVStore(TierConfig(0, str(tmp_path / "kv"), 8 * block, 0.0), kv, BS)
    originals = demote_prefix(store, 2)  # no host tier: straight to disk
    result = load(store, [8, 9, 10, 11, 12])
    assert result == LoadResult(LoadState.DONE, 2 * BS)
    assert all(torch.equal(store.kv_cache[8 + i].view(torch.uint8), originals[i].view(torch.uint8)) for i in range(2))
    assert store.snapshot().hit_blocks == {KVTier.DISK: 2}


def test_the_load_rate_is_the_copys_not_the_wait_until_the_next_poll(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    store.cost = LoadCostModel({KVTier.HOST: 1.0, KVTier.DISK: 1.0}, BLOCK, BS)  # a prior of 1 B/s
    demote_prefix(store, 2)
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) > 0
    time.sleep(0.5)  # an engine step: the load is polled long after its copies finished
    assert store.poll("r").state is LoadState.DONE
    # one sample moves the estimate by a fifth: 1 KiB over the 0.5-s wait would give ~400 B/s; the copy
    # itself (well under 10 ms even on a loaded CI machine) gives > 20 KB/s
    assert store.cost.bandwidth(KVTier.HOST) > 2e4


def test_an_offered_block_is_below_the_gpu_before_it_is_evicted(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    original = store.kv_cache[0].clone()
    store.offer(0, HASHES[0])  # cached-free: queued, copied with the step's batch
    store.between_steps()
    store.demote(0, HASHES[0])  # the eviction finds it kept: nothing more is copied
    store.kv_cache[0].fill_(7)  # the block's new content
    assert load(store, [8, 9, 10, 11, 12]).num_loaded_tokens == BS
    assert torch.equal(store.kv_cache[8], original)
    assert store.snapshot().demoted_blocks == {KVTier.HOST: 1}


def test_a_load_into_a_block_whose_demotion_is_only_queued_copies_the_old_bytes_out_first(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)
    first = demote_prefix(store, 1)[0]  # HASHES[0] on host
    second = store.kv_cache[5].clone()
    store.offer(5, HASHES[1])  # block 5's bytes are queued for the host, not copied yet
    # a load writes HASHES[0] into block 5 (as if block 5 had been evicted and allocated to it)
    assert store.start_load("r", TOKENS[:2 * BS], [5, 6], 0) == BS
    assert wait_done(store, "r").num_loaded_tokens == BS and torch.equal(store.kv_cache[5], first)
    assert load(store, [8, 9, 10, 11, 12]).num_loaded_tokens == 2 * BS
    assert torch.equal(store.kv_cache[9], second)  # HASHES[1]'s bytes survived the load into block 5


def test_a_host_victim_is_written_to_disk_from_its_retired_slot(tmp_path: Path) -> None:
    kv = torch.randn(16, 2, 2, BS, 1, 8, generator=torch.Generator().manual_seed(0))
    store = TieredKVStore(TierConfig(1 * BLOCK, str(tmp_path / "kv"), 4 * BLOCK, 0.0), kv, BS, spill_window_blocks=1)
    originals = [kv[i].clone() for i in range(3)]
    store.offer(0, HASHES[0])
    store.offer(1, HASHES[1])  # evicts HASHES[0] from host: its slot is retired and written to disk
    store.offer(2, HASHES[2])  # the spill window (1 slot) is in flight: HASHES[1] is dropped
    store.between_steps()
    store.flush()
    assert [store.lower_tier_of(h) for h in HASHES[:3]] == [KVTier.DISK, None, KVTier.HOST]
    assert store.snapshot().spills_dropped == 1
    kv[:3].fill_(0)
    store.offer(3, HASHES[3])  # the retired slot was released by the reap: this spill is not dropped
    store.flush()
    assert store.lower_tier_of(HASHES[2]) is KVTier.DISK and store.snapshot().spills_dropped == 1
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == BS
    assert wait_done(store, "r").num_loaded_tokens == BS and torch.equal(kv[8], originals[0])


def test_a_disk_only_tier_stages_through_a_spare_slot(tmp_path: Path) -> None:
    kv = torch.randn(16, 2, 2, BS, 1, 8, generator=torch.Generator().manual_seed(0))
    store = TieredKVStore(TierConfig(0, str(tmp_path / "kv"), 4 * BLOCK, 0.0), kv, BS, spill_window_blocks=1)
    original = kv[0].clone()
    store.offer(0, HASHES[0])
    store.offer(1, HASHES[1])  # the one spare slot is still on its way to disk: dropped
    store.flush()
    assert store.lower_tier_of(HASHES[0]) is KVTier.DISK and store.lower_tier_of(HASHES[1]) is None
    assert store.snapshot().spills_dropped == 1
    kv[0].fill_(0)
    assert load(store, [8, 9, 10, 11, 12]).num_loaded_tokens == BS and torch.equal(kv[8], original)


def test_an_offered_block_dropped_below_is_not_copied_again_when_evicted(tmp_path: Path) -> None:
    """Its offer was its chance: copying it at the eviction would put a copy on the engine's critical path
    and push out a block the tier chose to keep."""
    store = make_store(tmp_path, host_blocks=1)
    store.offer(0, HASHES[0])
    store.offer(1, HASHES[1])  # the host tier (1 block, no disk) drops HASHES[0]
    store.between_steps()
    store.demote(0, HASHES[0])
    store.flush()
    assert store.lower_tier_of(HASHES[0]) is None and store.lower_tier_of(HASHES[1]) is KVTier.HOST
    assert store.snapshot().demoted_blocks == {KVTier.HOST: 2}


def test_a_block_evicted_without_an_offer_is_kept_at_the_eviction(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2)
    original = store.kv_cache[3].clone()
    store.offer(3, HASHES[1])
    store.demote(3, HASHES[0])  # the block now carries another hash than it was offered with
    store.kv_cache[3].fill_(0)
    assert store.lower_tier_of(HASHES[0]) is KVTier.HOST
    assert load(store, [8, 9, 10, 11, 12]).num_loaded_tokens == 2 * BS  # HASHES[1] from the offer's copy
    assert torch.equal(store.kv_cache[8], original) and torch.equal(store.kv_cache[9], original)
