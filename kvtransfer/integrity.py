"""Integrity of the KV hand-off: per-block checksums (engine/kv_integrity.py) checked on arrival.

Where the work runs is the point: the prefill engine checksums a prompt's blocks in the step that
finished them, and the decode side verifies landed blocks on its engine thread, between two steps,
right before the sequence joins the batch. The KV link thread, which only posts and polls NIXL,
never touches the device, never synchronises and never waits for the GPU behind the engine's work
(the integrity pass on the link thread was what made hand-offs under load take ~1 s).
"""

from __future__ import annotations

import torch

from engine.kv_integrity import block_checksums, mismatched_blocks
from kvtransfer.base import LandedKV
from kvtransfer.faults import Fault, FaultInjector, corrupt_block_byte
from kvtransfer.shards import KVShards

__all__ = ["LandedVerifier", "block_checksums", "mismatched_blocks"]


class LandedVerifier:
    """Decode side: is a landed request's KV what the sender checksummed? Call it on the thread that
    owns the KV cache's device work (the engine thread), after the DONE notice and before the blocks
    are read. With tensor parallelism it also asks the follower ranks for their shards' checksums."""

    def __init__(self, kv_cache: torch.Tensor, *, enabled: bool = True, faults: FaultInjector | None = None,
                 shards: KVShards | None = None) -> None:
        self._kv_cache = kv_cache
        self._enabled = enabled
        self._faults = faults or FaultInjector()
        self._shards = shards

    def problem(self, landed: LandedKV) -> str:
        """Empty when every rank's blocks match the notice's checksums (or checksums are off)."""
        if self._faults.should_inject(Fault.CORRUPT_DESTINATION):
            corrupt_block_byte(self._kv_cache, landed.block_ids[0])
        expected = landed.payload.checksums
        if not self._enabled or expected is None:
            return ""
        block_ids = landed.block_ids
        n, tp = len(block_ids), 1 + (len(self._shards.infos) if self._shards is not None else 0)
        if len(expected) != n * tp:
            return f"checksum mismatch: {len(expected)} checksums for {n} blocks x {tp} ranks"
        bad = [(0, b) for b in mismatched_blocks(self._kv_cache, block_ids, expected[:n])]
        if self._shards is not None:
            try:
                follower_sums = self._shards.checksums(block_ids)
            except Exception as e:  # unverifiable counts as failed: the decode side recomputes
                return f"checksum mismatch: follower ranks could not checksum their blocks: {e}"
            for rank, actual in enumerate(follower_sums, start=1):
                want = expected[rank * n:(rank + 1) * n]
                bad += [(rank, b) for b, got, w in zip(block_ids, actual, want, strict=True) if got != w]
        if not bad:
            return ""
        where = [f"rank {r} block {b}" if tp > 1 else str(b) for r, b in bad[:8]]
        return f"checksum mismatch in {len(bad)} block(s): [{', '.join(where)}]"
