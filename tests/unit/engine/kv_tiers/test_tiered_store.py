"""TieredKVStore on a plain CPU KV pool: demotion, promotion, spills, faults and cancellation.

The pool is [num_blocks, layers=2, 2, block_size=4, kv_heads=1, head_dim=8] float32: 512 B a block.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.types import LoadFailure, LoadResult, LoadState, Tier, TierConfig
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
    assert snap.hit_blocks == {Tier.HOST: 2} and snap.pinned_blocks == {Tier.HOST: 0, Tier.DISK: 0}


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
    assert store.lower_tier_of(HASHES[0]) is Tier.DISK and store.lower_tier_of(HASHES[1]) is Tier.HOST
    result = load(store, [8, 9, 10, 11, 12])
    assert result.num_loaded_tokens == 2 * BS
    assert torch.equal(store.kv_cache[8], originals[0]) and torch.equal(store.kv_cache[9], originals[1])
    assert store.snapshot().hit_blocks == {Tier.DISK: 1, Tier.HOST: 1}


def test_a_full_disk_tier_drops_its_oldest_file(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=2)
    demote_prefix(store, 3)
    assert store.lower_tier_of(HASHES[0]) is None
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == sorted(
        store._files.path(h).name for h in HASHES[1:3])  # type: ignore[union-attr]


def test_a_flipped_byte_on_disk_is_a_bad_checksum_and_the_block_is_recomputed(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    demote_prefix(store, 2)
    path = store._files.path(HASHES[1])  # type: ignore[union-attr]
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
    store._files.path(HASHES[0]).unlink()  # type: ignore[union-attr]
    assert load(store, [8, 9, 10, 11, 12]) == LoadResult(LoadState.DONE, 0, (LoadFailure.MISSING_FILE,))
    assert store.snapshot().fallbacks == {LoadFailure.MISSING_FILE: 1}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make a write fail with ENOSPC")
def test_a_full_disk_drops_the_block_and_counts_it(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    os.symlink("/dev/full", store._files.path(HASHES[0]))  # type: ignore[union-attr]  # writes get ENOSPC
    store.demote(0, HASHES[0])
    store.flush()
    assert store.lower_tier_of(HASHES[0]) is None
    assert store.snapshot().fallbacks == {LoadFailure.DISK_FULL: 1}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to make a write fail with ENOSPC")
def test_a_load_queued_behind_a_failed_write_fails_as_disk_full(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=0, disk_blocks=4)
    os.symlink("/dev/full", store._files.path(HASHES[0]))  # type: ignore[union-attr]
    store.demote(0, HASHES[0])  # not reaped: the load is planned while the write is still recorded
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == BS
    assert wait_done(store, "r") == LoadResult(LoadState.DONE, 0, (LoadFailure.DISK_FULL,))
    assert store.lower_tier_of(HASHES[0]) is None and store.snapshot().fallbacks == {LoadFailure.DISK_FULL: 1}


def test_cancel_releases_every_pin_and_forgets_the_load(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=1, disk_blocks=4)
    demote_prefix(store, 2)
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == 2 * BS
    assert store.snapshot().pinned_blocks == {Tier.HOST: 1, Tier.DISK: 1}
    assert store.cancel("r") and not store.cancel("r")
    snap = store.snapshot()
    assert snap.pinned_blocks == {Tier.HOST: 0, Tier.DISK: 0} and snap.loads_in_flight == 0


def test_entries_pinned_by_a_load_survive_later_demotions(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=1)
    original = demote_prefix(store, 1)[0]
    assert store.start_load("r", TOKENS, [8, 9, 10, 11, 12], 0) == BS  # pins HASHES[0]
    store.demote(5, HASHES[2])  # the only host slot is pinned: this block is not kept
    assert store.lower_tier_of(HASHES[2]) is None and store.lower_tier_of(HASHES[0]) is Tier.HOST
    assert store.poll("r").num_loaded_tokens == BS and torch.equal(store.kv_cache[8], original)


def test_an_earlier_runs_files_are_not_trusted(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "00000000000000aa.kv").write_bytes(b"old")
    make_store(tmp_path, host_blocks=0, disk_blocks=2)
    assert list((tmp_path / "kv").iterdir()) == []
