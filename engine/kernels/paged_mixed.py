"""A mixed step's attention: prompt chunks in the prefill kernel, the decode rows in the decode kernel.

Treated as prefill rows (DecodeRows.PREFILL_TILES, before the tables), each decode sequence owns a
whole query tile: with 128-row tiles and 4 heads a group, 4 useful rows of 128 are multiplied against
the sequence's entire context, so 64 decodes beside two 1k chunks doubled the step's matrix work.
The prefill kernel can attend them inline with a decode tile (DecodeRows.INLINE, one launch); here
(DecodeRows.DECODE_KERNEL) it skips them and the decode kernel (varlen mode) attends them with its
G-row tiles and split-KV, writing the other rows of the same output: one or two more launches (host
time in an eager step), no gather, no host sync: both kernels read `query_start_loc` on the device.
"""

from __future__ import annotations

import torch

from engine.kernels.attention_tiles import DECODE_TABLE, DecodeConfig, DecodeRows, PrefillConfig, decode_config
from engine.kernels.paged_decode import paged_decode
from engine.kernels.paged_prefill import paged_prefill


def paged_mixed(
    query: torch.Tensor,  # [T, H_q, D]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
    layer: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    num_decode_rows: int,  # sequences with one query row (known on the host)
    num_sms: int,
    max_seq_len: int | None,
    out: torch.Tensor | None = None,  # [T, H_q, D]
    prefill: PrefillConfig | None = None,
    decode: DecodeConfig | None = None,
) -> torch.Tensor:
    """Same result as `paged_prefill` over the whole batch; the decode config defaults by the decode
    rows' own shape class (their count and `max_seq_len`)."""
    out = paged_prefill(query, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale, out=out,
                        config=prefill, decode_rows=DecodeRows.DECODE_KERNEL)
    num_kv_heads = kv_cache.shape[4]
    decode = decode or decode_config(num_decode_rows, num_kv_heads, num_sms, max_seq_len)
    splits = decode.num_splits(num_decode_rows, num_kv_heads, num_sms, max_seq_len)
    return paged_decode(query, kv_cache, layer, block_tables, seq_lens, scale, splits, out=out,
                        block_n=decode.block_n, num_warps=decode.num_warps, num_stages=decode.num_stages,
                        query_start_loc=query_start_loc)


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, dtype: torch.dtype) -> int:
    """Compile the varlen decode kernel of every default decode config, with and without splits,
    before serving. Reads the cache, writes nothing to it. Returns the number of launches."""
    head_dim, device = kv_cache.shape[-1], kv_cache.device
    query = torch.zeros((2, num_q_heads, head_dim), dtype=dtype, device=device)
    tables = torch.zeros((2, 1), dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    starts = torch.arange(3, dtype=torch.int32, device=device)
    launches = 0
    for config in sorted(set(DECODE_TABLE.values()), key=DecodeConfig.label):
        for splits in (1, 2):
            paged_decode(query, kv_cache, 0, tables, lens, 1.0, splits, block_n=config.block_n,
                         num_warps=config.num_warps, num_stages=config.num_stages, query_start_loc=starts)
            launches += 1
    return launches
