"""The KV block checksum: its definition and its torch reference.

A block's bytes are read as int16 words x_0..x_{W-1} and folded Fletcher-style into two exact integer
sums:

    A = sum(x_i)                  B = sum(((i mod 65521) + 1) * x_i)
    checksum = (A mod 2^32) << 32 | (B mod 2^32)

Any single flipped byte changes x_i by 0 < |d| < 2^16, hence A by d, which is never 0 mod 2^32:
detection is guaranteed. B (position-weighted) also catches swapped words or blocks landing at the
wrong id. It is not a cryptographic hash; it guards against transport and indexing bugs.

The Triton kernel (engine/kernels/kv_checksum.py) computes the same numbers from the same constants;
engine/kv_integrity.py picks one of the two and applies them to a KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHECKSUM_MOD = 65521  # largest prime below 2^16, as in Adler-32
_LOW32 = 0xFFFFFFFF
_CHUNK_BLOCKS = 16  # reference: bounds the float64 temporary to 4 * 16 * bytes_per_block bytes
# Reference: B is summed in float64 (a BLAS matrix-vector product, far cheaper than int64 multiply +
# sum on CPU): every product is an integer below 2^31, so partial sums stay exact below 2^53.
_SEGMENT_WORDS = 1 << 21


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
