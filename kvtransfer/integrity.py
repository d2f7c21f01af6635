"""Integrity of the KV hand-off: per-block checksums (engine/kv_integrity.py) checked on arrival.

Where the work runs is the point: the prefill engine checksums a prompt's blocks in the step that
finished them, and the decode side verifies landed blocks on its engine thread, between two steps,
right before the sequence joins the batch. The KV link thread, which only posts and polls NIXL,
never touches the device, never synchronises and never waits for the GPU behind the engine's work
(the integrity pass on the link thread was what made hand-offs under load take ~1 s).

What each checksum covers is the sending rank's blocks as that rank held them; the notice's groups
(`LandedKV.checksum_groups`) say where they lie here: a whole block of one of our ranks, or, from a
prefill worker of more pipeline stages, a stage's layer slice of it (kvtransfer/stages.py). Every
rank checks what landed on it, whatever the pair's split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_integrity import block_checksums, layer_slice_checksums, mismatched_blocks
from kvtransfer.base import LandedKV
from kvtransfer.faults import Fault, FaultInjector, corrupt_block_byte
from kvtransfer.shards import KVShards
from kvtransfer.stages import ChecksumGroup

__all__ = ["LandedVerifier", "block_checksums", "group_checksums", "mismatched_blocks"]


def group_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int], group: ChecksumGroup) -> list[int]:
    """The checksums of one group's part of `block_ids` on the rank holding `kv_cache` (group.rank's)."""
    if group.layers is None:
        return block_checksums(kv_cache, block_ids)
    return layer_slice_checksums(kv_cache, block_ids, group.layers.dst_first, group.layers.num_layers)


class LandedVerifier:
    """Decode side: is a landed request's KV what the sender checksummed? Call it on the thread that
    owns the KV cache's device work (the engine thread), after the DONE notice and before the blocks
    are read. With tensor or pipeline parallelism it also asks the follower ranks for the checksums
    of their groups."""

    def __init__(self, kv_cache: torch.Tensor, *, enabled: bool = True, faults: FaultInjector | None = None,
                 shards: KVShards | None = None) -> None:
        self._kv_cache = kv_cache
        self._enabled = enabled
        self._faults = faults or FaultInjector()
        self._shards = shards
        num_ranks = 1 + (len(shards.infos) if shards is not None else 0)
        self._rank_groups = tuple(ChecksumGroup(rank) for rank in range(num_ranks))  # a sender of our split

    def problem(self, landed: LandedKV) -> str:
        """Empty when every group's blocks match the notice's checksums (or checksums are off)."""
        if self._faults.should_inject(Fault.CORRUPT_DESTINATION):
            corrupt_block_byte(self._kv_cache, landed.block_ids[0])
        corrupt_rank = (len(self._rank_groups) - 1 if self._shards is not None
                        and self._faults.should_inject(Fault.CORRUPT_SHARD_DESTINATION) else None)
        expected = landed.payload.checksums
        if not self._enabled or expected is None:
            return ""
        block_ids, groups = landed.block_ids, landed.checksum_groups or self._rank_groups
        n = len(block_ids)
        if len(expected) != n * len(groups):
            return f"checksum mismatch: {len(expected)} checksums for {n} blocks x {len(groups)} groups"
        try:
            actual = self._actual(block_ids, groups, corrupt_rank)
        except Exception as e:  # unverifiable counts as failed: the decode side recomputes
            return f"checksum mismatch: follower ranks could not checksum their blocks: {e}"
        bad = [(g, b) for i, g in enumerate(groups)
               for b, got, want in zip(block_ids, actual[i], expected[i * n:(i + 1) * n], strict=True) if got != want]
        if not bad:
            return ""
        where = [_where(g, b) if len(groups) > 1 else str(b) for g, b in bad[:8]]
        return f"checksum mismatch in {len(bad)} block(s): [{', '.join(where)}]"

    def _actual(self, block_ids: tuple[int, ...], groups: Sequence[ChecksumGroup],
                corrupt_rank: int | None) -> list[list[int]]:
        """Each group's checksums, computed by the rank holding it (followers in one round trip)."""
        per_rank: dict[int, list[int]] = {0: [s for g in groups if g.rank == 0
                                              for s in group_checksums(self._kv_cache, block_ids, g)]}
        if self._shards is not None and any(g.rank for g in groups):
            replies = self._shards.checksums(block_ids, tuple(groups), corrupt_rank)
            per_rank.update({rank: list(sums) for rank, sums in enumerate(replies, start=1)})
        n, cursor, out = len(block_ids), dict.fromkeys(per_rank, 0), []
        for g in groups:  # each rank's reply is its groups' checksums, in group order
            start = cursor.get(g.rank, 0)
            sums = per_rank.get(g.rank, [])[start:start + n]
            if len(sums) != n:
                raise ValueError(f"rank {g.rank} returned {len(sums)} checksums for a group of {n} blocks")
            cursor[g.rank] = start + n
            out.append(sums)
        return out


def _where(group: ChecksumGroup, block: int) -> str:
    layers = "" if group.layers is None else f" layers {group.layers.dst_first}+{group.layers.num_layers}"
    return f"rank {group.rank}{layers} block {block}"
