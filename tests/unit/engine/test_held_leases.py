"""HeldLeases: a held prefill's blocks stay allocated until released once, or until the lease runs out."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.held_leases import HeldLeases
from engine.outputs import HeldBlocks


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def _held(bm: BlockManager, leases: HeldLeases, request_id: str, expires_at: float) -> HeldBlocks:
    block_ids, _ = bm.allocate_for_prompt([1, 2, 3, 4, 5], num_extra_slots=1)
    held = HeldBlocks(tuple(block_ids), num_prompt_tokens=5, num_cached_tokens=0, expires_at=expires_at)
    leases.hold(request_id, held)
    return held


def test_a_release_frees_the_blocks_once():
    bm, clock = BlockManager(8, 4, enable_prefix_caching=False), Clock()
    leases = HeldLeases(bm, clock)
    held = _held(bm, leases, "h", expires_at=20.0)
    assert "h" in leases and leases.get("h") is held and leases.num_blocks == 2 and bm.num_free_blocks == 6
    assert leases.release("h")
    assert not leases.release("h") and "h" not in leases and leases.get("h") is None
    assert leases.num_blocks == 0 and bm.num_free_blocks == 8


def test_only_leases_that_ran_out_are_released_as_expired():
    bm, clock = BlockManager(8, 4, enable_prefix_caching=False), Clock()
    leases = HeldLeases(bm, clock)
    _held(bm, leases, "early", expires_at=15.0)
    _held(bm, leases, "late", expires_at=30.0)
    assert leases.release_expired() == []
    clock.now = 15.0
    assert leases.release_expired() == ["early"]
    assert "late" in leases and leases.num_blocks == 2 and bm.num_free_blocks == 6
