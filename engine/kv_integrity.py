"""Cheap per-block checksums of KV blocks, computed where the KV cache lives (CPU or GPU).

They guard the KV hand-off: the prefill engine checksums a finished prompt's blocks in the step that
resolved them, the numbers travel in the transfer's DONE notice, and the decode engine recomputes
them over the landed blocks before the sequence joins its batch. A block's bytes are read as int16
words x_0..x_{W-1} and folded Fletcher-style into two exact integer sums:

    A = sum(x_i)                  B = sum(((i mod 65521) + 1) * x_i)
    checksum = (A mod 2^32) << 32 | (B mod 2^32)

Any single flipped byte changes x_i by 0 < |d| < 2^16, hence A by d, which is never 0 mod 2^32:
detection is guaranteed. B (position-weighted) also catches swapped words or blocks landing at the
wrong id. It is not a cryptographic hash; it guards against transport and indexing bugs.

Two implementations of the one definition: this module's torch reference (CPU, and CUDA when
triton is missing) and a bandwidth-bound Triton kernel (engine/kernels/kv_checksum.py) that reads
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

CHECKSUM_MOD = 65521  # largest prime below 2^16, as in Adler-32
_LOW32 = 0xFFFFFFFF
_CHUNK_BLOCKS = 16  # reference: bounds the float64 temporary to 4 * 16 * bytes_per_block bytes
# Reference: B is summed in float64 (a BLAS matrix-vector product, far cheaper than int64 multiply +
# sum on CPU): every product is an integer below 2^31, so partial sums stay exact below 2^53.
_SEGMENT_WORDS = 1 << 21


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


def mismatched_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
    """The block ids whose checksum differs from `expected` (same order as `block_ids`)."""
    if len(expected) != len(block_ids):
        raise ValueError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    actual = block_checksums(kv_cache, block_ids)
    return [bid for bid, got, want in zip(block_ids, actual, expected, strict=True) if got != want]


def reference_checksums(words: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """The definition, in torch: int64 [len(block_ids)] packed (A << 32 | B) of `words[block_ids]`."""
    weights = (torch.arange(words.shape[1], device=words.device, dtype=torch.int64) % CHECKSUM_MOD + 1).double()
    chunks = [_chunk_checksums(words, weights, block_ids[start:start + _CHUNK_BLOCKS])
              for start in range(0, len(block_ids), _CHUNK_BLOCKS)]
    return torch.cat(chunks)


def pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(A mod 2^32) << 32 | (B mod 2^32), elementwise on int64 tensors."""
    return (a & _LOW32) << 32 | (b & _LOW32)


def _chunk_checksums(words: torch.Tensor, weights: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.long).to(words.device, non_blocking=True)
    x = words.index_select(0, ids)  # [chunk, W] int16
    a = x.sum(dim=1, dtype=torch.int64)
    b = torch.zeros_like(a)
    for seg in range(0, x.shape[1], _SEGMENT_WORDS):
        cols = slice(seg, seg + _SEGMENT_WORDS)
        b += torch.mv(x[:, cols].double(), weights[cols]).to(torch.int64)
    return pack(a, b)


@functools.cache
def _cuda_impl() -> Callable[[torch.Tensor, Sequence[int]], torch.Tensor]:
    """The Triton kernel where triton imports (it is heavy: imported on first CUDA use), else the reference."""
    try:
        from engine.kernels.kv_checksum import block_checksums_triton
    except ImportError:
        return reference_checksums
    return block_checksums_triton
