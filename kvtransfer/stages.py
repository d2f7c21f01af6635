"""The KV hand-off plan of a pipeline-parallel prefill worker: which layers each rank sends, and where
they land in the decode worker's blocks.

A prefill worker of `pp` stages x `tp` tensor ranks holds, on world rank `stage * tp + r`, the KV of
its stage's layers for tensor rank r's KV heads: its blocks are `[stage layers, 2, block_size,
heads, head_dim]`, one contiguous region each (engine/kv_cache.py). A decode worker of the same TP
size and one stage holds every layer: `[num_layers, 2, ...]` per block. Because layers are the
outer dimension of a block, a stage's whole block is one contiguous byte range of the decode block:
starting at `first layer * bytes per layer`, as long as the stage's block. So every prefill rank
WRITEs its own blocks straight from its own KV cache (no gather on the prefill side) with one
descriptor per block, into the decode rank of its tensor rank at that offset: `LayerSlice` says
which layers, kvtransfer/nixl/descriptors.py `layer_slice_rows` gives the NIXL descriptor rows.

Routes between whole workers (`stage_routes`): each prefill rank WRITEs its blocks into the one decode
rank of its tensor rank whose layers contain its own, so a prefill of p stages feeds a decode of d
stages when every prefill stage's layers lie inside one decode stage's: p = d (whole blocks, rank to
rank), or merging (p = 2 into d = 1; p = 4 into d = 2 where the splits line up). Splitting one
prefill rank's layers over several decode ranks (p < d) is refused at the handshake, as is pipeline
parallelism combined with another TP size on the other side (kvtransfer/heads.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.layout import KVLayoutInfo


@dataclass(frozen=True)
class LayerSlice:
    """Layers [src_first, src_first + num_layers) of a source rank's block (indices within its block)
    land as layers [dst_first, ...) of the destination rank's block: one contiguous byte range on
    each side, since layers are a block's outer dimension."""

    src_first: int
    dst_first: int
    num_layers: int

    def __post_init__(self) -> None:
        if min(self.src_first, self.dst_first) < 0 or self.num_layers < 1:
            raise ValueError(f"bad layer slice {self}")


@dataclass(frozen=True)
class StageRoute:
    """Where one source rank's blocks go: into destination world rank `dst_rank`, whole (`layers`
    None: both ranks hold the same layers) or as a layer slice of the destination's blocks."""

    src_rank: int
    dst_rank: int
    layers: LayerSlice | None


def stage_route(src: KVLayoutInfo, dst_ranks: Sequence[KVLayoutInfo]) -> StageRoute | None:
    """The route of source rank `src` into the destination worker (`dst_ranks` in world-rank order);
    None when no destination rank of its tensor rank holds all of its layers."""
    for dst in dst_ranks:
        if dst.tp_rank != src.tp_rank or not (dst.layers.start <= src.layers.start
                                               and src.layers.stop <= dst.layers.stop):
            continue
        whole = dst.layers == src.layers
        piece = None if whole else LayerSlice(0, src.first_layer - dst.first_layer, src.num_layers)
        return StageRoute(src.world_rank, dst.world_rank, piece)
    return None


def stage_routes(src_ranks: Sequence[KVLayoutInfo], dst_ranks: Sequence[KVLayoutInfo]) -> tuple[StageRoute, ...]:
    """Every source rank's route, in world-rank order (ValueError naming the first rank without one)."""
    routes = []
    for src in src_ranks:
        route = stage_route(src, dst_ranks)
        if route is None:
            raise ValueError(f"stage {src.pp_rank}'s layers {_span(src.layers)} lie in no one stage of the other "
                             "side (splitting a stage's layers over several stages is not built)")
        routes.append(route)
    return tuple(routes)


@dataclass(frozen=True)
class ChecksumGroup:
    """Where one group of a DONE notice's checksums lies on the receiving worker. The notice carries
    one checksum per block (plan order) per group, group after group, in the sending worker's rank
    order: group i covers world rank `rank`'s blocks, whole (`layers` None), or only the layers
    `layers.dst_first .. + layers.num_layers` of them: a prefill stage checksums its own blocks,
    which land as that layer slice of a decode worker of fewer stages."""

    rank: int
    layers: LayerSlice | None = None


def checksum_groups(src_ranks: Sequence[KVLayoutInfo], dst_ranks: Sequence[KVLayoutInfo]) -> tuple[ChecksumGroup, ...]:
    """The groups of the checksums a sender of `src_ranks` puts in its notices, on the receiver of
    `dst_ranks` (both in world-rank order). Same stage split: one group per receiving rank, whole
    blocks (rank to rank, or per head slice under heterogeneous TP: kvtransfer/nixl/sliced.py).
    Another split: one group per sending rank, at its route (ValueError where a rank has none)."""
    if src_ranks[0].pp_size == dst_ranks[0].pp_size:
        return tuple(ChecksumGroup(rank) for rank in range(len(dst_ranks)))
    return tuple(ChecksumGroup(route.dst_rank, route.layers) for route in stage_routes(src_ranks, dst_ranks))


def describe_stages(ranks: Sequence[KVLayoutInfo]) -> str:
    """`PP2: layers 0-14 | 15-29`: how the handshake states a side's stages in an error."""
    spans = sorted({(r.pp_rank, _span(r.layers)) for r in ranks})
    return f"PP{ranks[0].pp_size}: layers " + " | ".join(span for _, span in spans)


def stage_layout_problem(src_ranks: Sequence[KVLayoutInfo],
                         dst_ranks: Sequence[KVLayoutInfo]) -> list[tuple[str, object, object]]:
    """(field, source, destination) for what keeps a source worker from writing its stages' layers
    into a destination worker of another pipeline-parallel size; empty when every rank has a route."""
    src, dst = src_ranks[0], dst_ranks[0]
    stages = ("pp_size", src.pp_size, dst.pp_size)
    per_rank = {"tp_rank", "pp_size", "pp_rank", "first_layer", "num_layers"}
    found = [m for m in src.mismatches(dst) if m[0] not in per_rank]
    if found:
        return [stages, *found]
    last = max(r.layers.stop for r in src_ranks), max(r.layers.stop for r in dst_ranks)
    if last[0] != last[1]:
        return [stages, ("model layers", *last)]
    try:
        stage_routes(src_ranks, dst_ranks)
    except ValueError as e:
        return [stages, ("layer ranges", describe_stages(src_ranks), describe_stages(dst_ranks)), ("route", str(e), "")]
    return []


def _span(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}"
