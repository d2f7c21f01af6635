"""KV tiers on CUDA: demotion on a side stream ordered before the engine stream's next writes, host and
disk promotion bit-exact, cancellation waiting for in-flight copies (engine/kv_tiers/store.py).

The pool is [64, layers=4, 2, 16, kv_heads=8, head_dim=128] bf16: 256 KiB a block.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.types import KVTier, LoadState, TierConfig
from tokenization.block_hashes import block_hashes

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BS = 16
BLOCK = 4 * 2 * BS * 8 * 128 * 2
TOKENS = list(range(1000, 1000 + 8 * BS + 1))
HASHES = block_hashes(TOKENS, BS)


def _store(tmp_path: Path, host_blocks: int, disk_blocks: int) -> TieredKVStore:
    kv = torch.randn(64, 4, 2, BS, 8, 128, device="cuda", dtype=torch.bfloat16)
    return TieredKVStore(TierConfig(host_blocks * BLOCK, str(tmp_path / "kv"), disk_blocks * BLOCK, 0.0), kv, BS)


def _wait(store: TieredKVStore, rid: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = store.poll(rid)
        if result.state is LoadState.DONE:
            return result.num_loaded_tokens
        time.sleep(0.001)
    raise AssertionError("load never finished")


def test_a_demotion_is_ordered_before_the_next_write_into_the_block(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=8, disk_blocks=0)
    original = store.kv_cache[0].clone()
    store.demote(0, HASHES[0])
    store.kv_cache[0].fill_(7)  # the engine stream's next write: must wait for the copy's event
    assert store.start_load("r", TOKENS, [0, 40, 41, 42, 43, 44, 45, 46, 47], BS * 0) == BS
    assert _wait(store, "r") == BS
    torch.cuda.synchronize()
    assert torch.equal(store.kv_cache[0], original)  # loaded back into block 0 over the 7s


def test_host_and_disk_blocks_come_back_bit_exact(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=16)
    originals = [store.kv_cache[i].clone() for i in range(6)]
    for i in range(6):
        store.demote(i, HASHES[i])
    store.flush()
    table = list(range(20, 29))
    assert store.start_load("r", TOKENS, table, 0) == 6 * BS
    assert _wait(store, "r") == 6 * BS
    torch.cuda.synchronize()
    assert all(torch.equal(store.kv_cache[20 + i], originals[i]) for i in range(6))
    hits = store.snapshot().hit_blocks
    assert hits[KVTier.HOST] == 2 and hits[KVTier.DISK] == 4


def test_cancel_waits_for_copies_and_releases_every_pin(tmp_path: Path) -> None:
    store = _store(tmp_path, host_blocks=2, disk_blocks=16)
    for i in range(6):
        store.demote(i, HASHES[i])
    store.flush()
    assert store.start_load("r", TOKENS, list(range(20, 29)), 0) == 6 * BS
    assert store.cancel("r")
    snap = store.snapshot()
    assert snap.pinned_blocks == {KVTier.HOST: 0, KVTier.DISK: 0} and snap.loads_in_flight == 0


def test_a_load_into_a_block_whose_demotion_is_only_queued_keeps_both_blocks_bytes(tmp_path: Path) -> None:
    """The load runs on its own stream: it must still follow the (queued, then batched) copy that reads
    the old bytes of its destination block, and that copy must see the old bytes."""
    store = _store(tmp_path, host_blocks=8, disk_blocks=0)
    first = store.kv_cache[0].clone()
    store.demote(0, HASHES[0])
    second = store.kv_cache[5].clone()
    store.offer(5, HASHES[1])  # queued for the host, not issued
    assert store.start_load("r", TOKENS[:2 * BS], [5, 6], 0) == BS  # HASHES[0] into block 5
    assert _wait(store, "r") == BS
    torch.cuda.synchronize()
    assert torch.equal(store.kv_cache[5], first)
    assert store.start_load("s", TOKENS, list(range(20, 29)), 0) == 2 * BS
    assert _wait(store, "s") == 2 * BS
    torch.cuda.synchronize()
    assert torch.equal(store.kv_cache[21], second)


def test_offered_blocks_spill_from_their_host_slots_bit_exact(tmp_path: Path) -> None:
    """A full host tier writes its victims to disk from the retired slots (after their copy's event)."""
    store = _store(tmp_path, host_blocks=2, disk_blocks=16)
    originals = [store.kv_cache[i].clone() for i in range(8)]
    for i in range(8):
        store.offer(i, HASHES[i])
    store.between_steps()  # one batch of 8 copies; 6 victims written from their slots
    store.flush()
    store.kv_cache[:8].fill_(3)
    assert store.start_load("r", TOKENS, list(range(20, 29)), 0) == 8 * BS
    assert _wait(store, "r") == 8 * BS
    torch.cuda.synchronize()
    assert all(torch.equal(store.kv_cache[20 + i], originals[i]) for i in range(8))
    assert store.snapshot().spills_dropped == 0
