"""Cheap per-block checksums of KV blocks, computed where the KV cache lives (CPU or GPU).

The sender checksums its source blocks before the WRITE and puts the values in the notification;
the receiver recomputes them over its destination blocks on arrival. A block's bytes are read as
int16 words x_0..x_{W-1} and folded Fletcher-style into two exact integer sums (no overflow for
blocks under ~8 GB):

    A = sum(x_i)                  B = sum(((i mod 65521) + 1) * x_i)
    checksum = (A mod 2^32) << 32 | (B mod 2^32)

Any single flipped byte changes x_i by 0 < |d| < 2^16, hence A by d, which is never 0 mod 2^32:
detection is guaranteed. B (position-weighted) also catches swapped words or blocks landing at the
wrong id. It is not a cryptographic hash; it guards against transport and indexing bugs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MOD = 65521  # largest prime below 2^16, as in Adler-32
_LOW32 = 0xFFFFFFFF
_CHUNK_BLOCKS = 16  # bounds the float64 temporary to 4 * 16 * bytes_per_block bytes
# B is summed in float64 (a BLAS matrix-vector product, far cheaper than int64 multiply + sum):
# every product is an integer below 2^31, so partial sums stay exact below 2^53 for 2^22 words.
_SEGMENT_WORDS = 1 << 21


def block_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """One 64-bit checksum per block id, in order. `kv_cache` is [num_blocks, ...], contiguous.

    Runs on kv_cache's device and synchronizes once per chunk of blocks (`.tolist()`)."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (block-major layout)")
    if not block_ids:
        return []
    words = kv_cache.view(kv_cache.shape[0], -1).view(torch.int16)  # [num_blocks, bytes_per_block / 2]
    weights = (torch.arange(words.shape[1], device=kv_cache.device, dtype=torch.int64) % _MOD + 1).double()
    out: list[int] = []
    for start in range(0, len(block_ids), _CHUNK_BLOCKS):
        ids = torch.tensor(block_ids[start : start + _CHUNK_BLOCKS], dtype=torch.long, device=kv_cache.device)
        x = words.index_select(0, ids)  # [chunk, W] int16
        a = x.sum(dim=1, dtype=torch.int64) & _LOW32
        b = torch.zeros_like(a)
        for seg in range(0, x.shape[1], _SEGMENT_WORDS):
            cols = slice(seg, seg + _SEGMENT_WORDS)
            b += torch.mv(x[:, cols].double(), weights[cols]).to(torch.int64)
        out.extend((a << 32 | b & _LOW32).tolist())
    return [v & 0xFFFFFFFFFFFFFFFF for v in out]


def mismatched_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
    """The block ids whose checksum differs from `expected` (same order as `block_ids`)."""
    if len(expected) != len(block_ids):
        raise ValueError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    actual = block_checksums(kv_cache, block_ids)
    return [bid for bid, got, want in zip(block_ids, actual, expected, strict=True) if got != want]
