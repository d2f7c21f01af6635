"""Heterogeneous tensor parallelism: a prefill worker of TP size p feeding a decode worker of TP size d.

Both shard the KV heads the same way, rank r holding the contiguous range [r * H/tp, (r+1) * H/tp)
of the model's H KV heads (engine/parallel). So rank i of the prefill and rank j of the decode share
the heads where their ranges overlap: for p < d each prefill rank splits its heads over d/p decode
ranks, for p > d each decode rank gathers its heads from p/d prefill ranks. `head_slices` lists
those overlaps; each is one WRITE of a head range of every block of the plan.

The rule two layouts must meet (`head_layout_problem`): the same model, dtype, block size, layers and
head dim, and the same total H = num_kv_heads (per rank) x tp_size, both TP sizes dividing H. A TP size
above H replicates heads (num_kv_heads 1 per rank), which gives num_kv_heads x tp_size = tp_size > H:
such a side never matches a side of another TP size, so replication is refused by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.layout import KVLayoutInfo

# Fields that may differ between a prefill and a decode worker of different TP sizes.
_PER_RANK_FIELDS = ("num_kv_heads", "tp_size", "tp_rank")


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_head, src_head + num_heads) of source rank `src_rank`'s shard land as heads
    [dst_head, dst_head + num_heads) of destination rank `dst_rank`'s shard (indices within each shard)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int

    def __post_init__(self) -> None:
        if min(self.src_rank, self.dst_rank, self.src_head, self.dst_head) < 0 or self.num_heads < 1:
            raise ValueError(f"bad head slice {self}")


def total_kv_heads(layout: KVLayoutInfo) -> int:
    """The model's KV heads as this side shards them (tp_size when heads are replicated: see above)."""
    return layout.num_kv_heads * layout.tp_size


def describe_layout(layout: KVLayoutInfo) -> str:
    """`TP2 x 4 KV heads per rank (8 in all)`: how the handshake states a side's layout in an error."""
    return f"TP{layout.tp_size} x {layout.num_kv_heads} KV heads per rank ({total_kv_heads(layout)} in all)"


def head_layout_problem(mine: KVLayoutInfo, theirs: KVLayoutInfo) -> list[tuple[str, object, object]]:
    """(field, mine, theirs) for what keeps two sides of different TP sizes from exchanging heads,
    tp_size first; empty when every rank's heads have exactly one home on the other side."""
    found = [m for m in mine.mismatches(theirs) if m[0] not in _PER_RANK_FIELDS]
    if total_kv_heads(mine) != total_kv_heads(theirs):
        found.append(("kv_heads", describe_layout(mine), describe_layout(theirs)))
    return [("tp_size", mine.tp_size, theirs.tp_size), *found] if found else []


def head_slices(total_heads: int, src_tp: int, dst_tp: int) -> tuple[HeadSlice, ...]:
    """Every (source rank, destination rank) overlap of heads, source rank first, then destination."""
    for name, tp in (("source", src_tp), ("destination", dst_tp)):
        if tp < 1 or total_heads % tp:
            raise ValueError(f"{name} TP size {tp} does not divide the {total_heads} KV heads")
    src_per, dst_per = total_heads // src_tp, total_heads // dst_tp
    slices = []
    for src in range(src_tp):
        lo, hi = src * src_per, (src + 1) * src_per
        for dst in range(lo // dst_per, (hi - 1) // dst_per + 1):
            start, end = max(lo, dst * dst_per), min(hi, (dst + 1) * dst_per)
            slices.append(HeadSlice(src, dst, start - lo, start - dst * dst_per, end - start))
    return tuple(slices)
