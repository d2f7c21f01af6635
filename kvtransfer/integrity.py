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

import contextlib
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

    Runs on kv_cache's device and synchronizes once (`.tolist()` at the end). The blocks' bytes must
    be final (the engine step that wrote them has been read back, or the WRITE has landed). On CUDA
    it runs on a high-priority side stream: on the default stream every chunk would queue behind the
    engine's in-flight steps (a 2k-token prefill step is tens of ms), which made the hand-off of a
    busy worker take hundreds of ms."""
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (block-major layout)")
    if not block_ids:
        return []
    with _side_stream(kv_cache.device):
        words = kv_cache.view(kv_cache.shape[0], -1).view(torch.int16)  # [num_blocks, bytes_per_block / 2]
        weights = (torch.arange(words.shape[1], device=kv_cache.device, dtype=torch.int64) % _MOD + 1).double()
        chunks = [_chunk_checksums(words, weights, block_ids[start : start + _CHUNK_BLOCKS])
                  for start in range(0, len(block_ids), _CHUNK_BLOCKS)]
        out: list[int] = torch.cat(chunks).tolist()
    return [v & 0xFFFFFFFFFFFFFFFF for v in out]


def _chunk_checksums(words: torch.Tensor, weights: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.long, device=words.device)
    x = words.index_select(0, ids)  # [chunk, W] int16
    a = x.sum(dim=1, dtype=torch.int64) & _LOW32
    b = torch.zeros_like(a)
    for seg in range(0, x.shape[1], _SEGMENT_WORDS):
        cols = slice(seg, seg + _SEGMENT_WORDS)
        b += torch.mv(x[:, cols].double(), weights[cols]).to(torch.int64)
    return a << 32 | b & _LOW32


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A high-priority CUDA stream of `device` as the current stream; nothing on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return torch.cuda.stream(stream)


def mismatched_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], expected: Sequence[int]) -> list[int]:
    """The block ids whose checksum differs from `expected` (same order as `block_ids`)."""
    if len(expected) != len(block_ids):
        raise ValueError(f"{len(expected)} checksums for {len(block_ids)} blocks")
    actual = block_checksums(kv_cache, block_ids)
    return [bid for bid, got, want in zip(block_ids, actual, expected, strict=True) if got != want]
