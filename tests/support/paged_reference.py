"""CPU references and fixtures for the paged attention kernel tests run under triton's interpreter.

The cache is the engine's block-major `[num_blocks, num_layers, 2, block_size, H_kv, D]`; block
tables are shuffled (never contiguous) and random caches are never zero, so a misread or unwritten
slot shows up.
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import AttentionMetadata


def make_cache(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random (never zero) cache, so unwritten or misread slots show up."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                        gen: torch.Generator) -> torch.Tensor:
    """Distinct, shuffled (non-contiguous) block ids per sequence; padding entries are 0."""
    need = [math.ceil(n / block_size) for n in seq_lens]
    ids = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    table = torch.zeros((len(seq_lens), max(max(need), 1) + 1), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[start:start + n]
        start += n
    return table


def reference(query: torch.Tensor, cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
              seq_lens: list[int], query_lens: list[int], scale: float) -> torch.Tensor:
    """Dense float64 causal attention: query rows are the last q_len positions of each context."""
    block_size, num_kv_heads = cache.shape[3], cache.shape[4]
    group = query.shape[1] // num_kv_heads
    outs, row = [], 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(seq_len)
        blocks = block_tables[i].long()[pos // block_size]
        k = cache[blocks, layer, 0, pos % block_size].double().repeat_interleave(group, dim=1)
        v = cache[blocks, layer, 1, pos % block_size].double().repeat_interleave(group, dim=1)
        q = query[row:row + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += q_len
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def meta_for(seq_lens: list[int], query_lens: list[int], block_tables: torch.Tensor,
             block_size: int) -> AttentionMetadata:
    slots = []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
