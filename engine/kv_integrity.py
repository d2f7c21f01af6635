"""Cheap per-block checksums of KV blocks, computed where the KV cache lives (CPU or GPU).

They guard the KV hand-off: the prefill engine checksums a finished prompt's blocks in the step that
resolved them, the numbers travel in the transfer's DONE notice, and the decode engine recomputes
them over the landed blocks before the sequence joins its batch. The checksum's definition and its
torch reference are in engine/block_checksum.py.

Two implementations of the one definition: the torch reference (CPU, and CUDA when triton is
missing) and a bandwidth-bound Triton kernel (engine/kernels/kv_checksum.py) that reads
each block once with no temporaries, so checksumming a 2k-token prompt of an 8B model (256 MiB) is a
fraction of a millisecond instead of the ~3 ms the reference's gather + float64 temporaries cost.
Both run on the caller's current stream: called on the engine thread right after a step, the
checksums are ordered after the step's KV writes with no extra synchronisation but the one that
reads the (few) results back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from engine.block_checksum import reference_checksums


def block_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """One 64-bit checksum per block id, in order. `kv_cache` is [num_blocks, ...], contiguous.

    The blocks' bytes must be final in stream order (the step that wrote them was launched on the
    current stream, or they landed before the caller learnt of it). Synchronises once to read back."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (block-major layout)")
    if not block_ids:
        return []
    words = kv_cache.view(kv_cache.shape[0], -1).view(torch.int16)  # [num_blocks, bytes_per_block / 2]
    impl = _cuda_impl() if kv_cache.is_cuda else reference_checksums
    packed = impl(words, block_ids)
    return [v & 0xFFFFFFFFFFFFFFFF for v in packed.tolist()]


def head_slice_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int], num_slices: int) -> list[int]:
    """The checksums of each block as the ranks of a decode worker of TP size `num_slices` hold it
    (heterogeneous TP: rank j holds heads [j * H/s, (j+1) * H/s) of the block, contiguous), rank-major:
    every block's slice 0 first. One slice is `block_checksums`. Costs one copy of the blocks."""
    if num_slices == 1 or not block_ids:
        return block_checksums(kv_cache, block_ids)
    heads = kv_cache.shape[4] // num_slices
    if heads * num_slices != kv_cache.shape[4]:
        raise ValueError(f"{num_slices} slices do not divide {kv_cache.shape[4]} KV heads")
    blocks = _selected(kv_cache, block_ids)
    return [s for j in range(num_slices) for s in _all_checksums(blocks.narrow(4, j * heads, heads))]


def layer_slice_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int], first_layer: int,
                          num_layers: int) -> list[int]:
    """The checksums of layers [first_layer, first_layer + num_layers) of each block, each slice read as
    a block of its own: what a pipeline stage holding just those layers computes over its blocks
    (its KV cache is `[num_blocks, stage layers, ...]`), so a decode worker of fewer stages can check
    each prefill stage's part of its blocks. Costs one copy of the slices, unless they are whole blocks."""
    if not 0 <= first_layer < first_layer + num_layers <= kv_cache.shape[1]:
        raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} are outside the "
                         f"{kv_cache.shape[1]} layers of a block")
    if num_layers == kv_cache.shape[1] or not block_ids:
        return block_checksums(kv_cache, block_ids)
    return _all_checksums(_selected(kv_cache, block_ids).narrow(1, first_layer, num_layers))


def _selected(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    return kv_cache.index_select(0, torch.tensor(list(block_ids), device=kv_cache.device))


def _all_checksums(blocks: torch.Tensor) -> list[int]:
    """The checksums of every block of a (possibly strided) view, as contiguous blocks of its shape."""
    return block_checksums(blocks.contiguous(), list(range(blocks.shape[0])))


def mismatched_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
    """The block ids whose checksum differs from `expected` (same order as `block_ids`)."""
    if len(expected) != len(block_ids):
        raise ValueError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    actual = block_checksums(kv_cache, block_ids)
    return [bid for bid, got, want in zip(block_ids, actual, expected, strict=True) if got != want]


@functools.cache
def _cuda_impl() -> Callable[[torch.Tensor, Sequence[int]], torch.Tensor]:
    """The Triton kernel where triton imports (it is heavy: imported on first CUDA use), else the reference."""
    try:
        from engine.kernels.kv_checksum import block_checksums_triton
    except ImportError:
        return reference_checksums
    return block_checksums_triton
