"""The torch attention backend: the production CPU path, and the reference the Triton kernels are tested on.

Reads the context straight from the paged cache `[num_blocks, num_layers, 2, block_size, H_kv, D]`.
Decode-only steps (the common case under continuous batching) take one batched path: every
sequence's blocks are gathered (one memcpy per block) into a padded `[B, S_max, H_kv, D]` tensor
and masked by length, so a step costs a handful of kernels per layer instead of a loop over
sequences. Prefill chunks
run one sequence at a time over exactly their own blocks. Both use SDPA, which on CPU runs a
flash kernel that accumulates the softmax in float32 for half types.

An FP8 cache (`float8_e4m3fn`) stores `x / scale` saturated to +-448 and is read back as `stored * scale`
in the query's dtype, after the gather (so only the context's blocks are converted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import UNSCALED, AttentionBackend, AttentionMetadata, KVScale
from engine.quant.fp8 import FP8_DTYPE, to_fp8


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        layer: int,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        kv_scale: KVScale = UNSCALED,
    ) -> None:
        block_size = kv_cache.shape[3]
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * block_size
        # index_put_ on per-layer views writes straight into the pool; the cast is a no-op unless the
        # cache is kept in a narrower dtype than the activations.
        if kv_cache.dtype == FP8_DTYPE:
            key, value = to_fp8(key, torch.tensor(kv_scale.k)), to_fp8(value, torch.tensor(kv_scale.v))
        kv_cache[:, layer, 0][blocks, offsets] = key.to(kv_cache.dtype)
        kv_cache[:, layer, 1][blocks, offsets] = value.to(kv_cache.dtype)

    def attend(
        self,
        query: torch.Tensor,  # [T, H_q, D]
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor:  # [T, H_q, D]
        k_cache = PagedCache(kv_cache[:, layer, 0], kv_scale.k)  # [num_blocks, block_size, H_kv, D] views
        v_cache = PagedCache(kv_cache[:, layer, 1], kv_scale.v)
        if meta.is_decode_only:
            return _decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
        return _mixed(query, k_cache, v_cache, meta, scale)


@dataclass(frozen=True)
class PagedCache:
    """One layer's K or V pages `[num_blocks, block_size, H_kv, D]` and how to read them as activations."""

    pages: torch.Tensor
    scale: float  # FP8 pages only: real = stored * scale

    @property
    def block_size(self) -> int:
        return self.pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.pages.shape[2]

    def gather(self, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`gather_blocks` of the pages, in `dtype` (an FP8 cache dequantized with its scale)."""
        rows = gather_blocks(self.pages, table)
        if self.pages.dtype != FP8_DTYPE:
            return rows
        return (rows.float() * self.scale).to(dtype)


def _mixed(
    query: torch.Tensor, k_cache: PagedCache, v_cache: PagedCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """A step with prefill chunks: decodes still go through the batched path, chunks one by one."""
    out = torch.empty_like(query)
    starts = _starts(meta.query_lens_cpu)
    decodes = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    if decodes:
        seqs = torch.tensor(decodes, device=query.device)
        rows = torch.tensor([starts[i] for i in decodes], device=query.device)
        max_len = max(meta.seq_lens_cpu[i] for i in decodes)
        out[rows] = _decode(
            query[rows], k_cache, v_cache, meta.block_tables[seqs], meta.seq_lens[seqs], max_len, scale
        )
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if q_len > 1:
            rows_i = slice(starts[i], starts[i] + q_len)
            out[rows_i] = _prefill(query[rows_i], k_cache, v_cache, meta.block_tables[i], seq_len, scale)
    return out


def _decode(
    query: torch.Tensor,  # [B, H_q, D], one query token per sequence
    k_cache: PagedCache,
    v_cache: PagedCache,
    block_tables: torch.Tensor,  # [B, >= ceil(max_len / block_size)]
    seq_lens: torch.Tensor,  # [B]
    max_len: int,
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.num_kv_heads
    table = block_tables[:, : _cdiv(max_len, k_cache.block_size)]
    keys = k_cache.gather(table, query.dtype).transpose(1, 2)  # [B, H_kv, S_pad, D] (strided view)
    values = v_cache.gather(table, query.dtype).transpose(1, 2)
    # GQA without repeating K/V: the G query heads sharing a KV head become G query rows of it.
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    positions = torch.arange(keys.shape[2], device=query.device)
    # Additive mask: -inf on the padding slots past each sequence's length (stale data of other blocks).
    mask = torch.zeros((batch, keys.shape[2]), dtype=query.dtype, device=query.device)
    mask.masked_fill_(positions >= seq_lens.unsqueeze(1), float("-inf"))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.view(batch, 1, 1, -1), scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`cache[table]` as `[B, n * block_size, H_kv, D]` (`table` is `[B, n]` or `[n]` for one sequence).

    Goes through `index_select` on a `[num_blocks, block_size * H_kv * D]` view: one memcpy per block,
    several times faster on CPU than advanced indexing, which copies element by element.
    """
    num_blocks, block_size, heads, dim = cache.shape
    rows = cache.flatten(1).index_select(0, table.reshape(-1).long())
    return rows.view(*table.shape[:-1], table.shape[-1] * block_size, heads, dim)


def _prefill(
    query: torch.Tensor,  # [q, H_q, D]: the last q positions of a context of seq_len tokens
    k_cache: PagedCache,
    v_cache: PagedCache,
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    q_len = query.shape[0]
    table = block_table[: _cdiv(seq_len, k_cache.block_size)]
    keys = k_cache.gather(table, query.dtype)[:seq_len].transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
    values = v_cache.gather(table, query.dtype)[:seq_len].transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H_q, q, D]
    if q_len == seq_len:  # no cached prefix: SDPA's top-left causal mask is the right one
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:  # row j sees context positions <= seq_len - q_len + j
        rows = torch.arange(q_len, device=query.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=query.device) <= rows + (seq_len - q_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _starts(query_lens: tuple[int, ...]) -> list[int]:
    starts, total = [], 0
    for q in query_lens:
        starts.append(total)
        total += q
    return starts


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
