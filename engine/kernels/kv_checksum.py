"""KV block checksums in one bandwidth-bound pass (the definition: engine/block_checksum.py).

Grid (selected block, split): each program folds `SPLIT_WORDS` consecutive int16 words of one block
into partial sums A = sum(x) and B = sum(w * x), w = (word index mod 65521) + 1, both exact in int64
(|w * x| < 2^31, so the product fits int32 and is widened before summing). The partials of a block's
splits are then added by torch and packed. No gather copy and no float temporaries: the block is read
once, straight from the cache by its id.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine.block_checksum import CHECKSUM_MOD, pack

_TILE = 2048  # words per loop iteration of one program
_SPLIT_WORDS = 32 * _TILE  # words per program: a 2 MiB block (1 Mi words) is 16 programs


@triton.jit
def _checksum_kernel(
    words_ptr,  # [num_blocks, W] int16, row-major: block b starts at b * W
    ids_ptr,  # [n] int64 block ids
    partial_ptr,  # [n, num_splits, 2] int64: (A, B) partial sums
    W,
    num_splits,
    MOD: tl.constexpr,
    TILE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    block = tl.load(ids_ptr + row)
    base = words_ptr + block * W
    acc_a = tl.zeros([TILE], dtype=tl.int64)
    acc_b = tl.zeros([TILE], dtype=tl.int64)
    start = split * SPLIT
    for off in range(0, SPLIT, TILE):
        idx = start + off + tl.arange(0, TILE)
        mask = idx < W
        x = tl.load(base + idx, mask=mask, other=0).to(tl.int32)
        w = idx % MOD + 1
        acc_a += x.to(tl.int64)
        acc_b += (x * w).to(tl.int64)
    out = partial_ptr + (row * num_splits + split) * 2
    tl.store(out, tl.sum(acc_a, axis=0))
    tl.store(out + 1, tl.sum(acc_b, axis=0))


def block_checksums_triton(words: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """int64 [len(block_ids)] packed checksums of `words[block_ids]` (words: [num_blocks, W] int16)."""
    if words.dtype != torch.int16 or words.dim() != 2 or not words.is_contiguous():
        raise ValueError(f"words must be a contiguous [num_blocks, W] int16 tensor, got {words.dtype} "
                         f"{tuple(words.shape)}")
    n, width = len(block_ids), words.shape[1]
    ids = torch.tensor(block_ids, dtype=torch.int64).to(words.device, non_blocking=True)
    num_splits = triton.cdiv(width, _SPLIT_WORDS)
    partial = torch.empty((n, num_splits, 2), dtype=torch.int64, device=words.device)
    _checksum_kernel[(n, num_splits)](words, ids, partial, width, num_splits,
                                      MOD=CHECKSUM_MOD, TILE=_TILE, SPLIT=_SPLIT_WORDS)
    sums = partial.sum(dim=1)
    return pack(sums[:, 0], sums[:, 1])
