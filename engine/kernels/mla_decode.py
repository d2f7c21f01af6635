"""MLA decode over the latent paged cache: one query token per sequence, split-KV, absorbed projections.

The cache holds one vector per token and layer, `[latent (C) | rotated shared key (R)]`
(engine/kv_cache.py, `KVLayout.LATENT`). With W_UK folded into the query (engine/layers/mla.py), every
head's query is `[q_latent (C) | q_rope (R)]` and attends over that one vector per token as its key,
while the value is the latent part alone; W_UV is applied to the output afterwards. So this is MQA
with a wide head, and the point of the kernel is to read each latent once for all heads:

- Grid `(B, cdiv(H, BLOCK_H), num_splits)`. A program owns one sequence, `BLOCK_H` query heads (all
  16 of DeepSeek-V2-Lite in one tile) and one contiguous chunk of the context. Per tile of `BLOCK_N`
  tokens it loads the latents `[BLOCK_N, C]` and rope keys `[BLOCK_N, R]` through the block table,
  scores `q_lat . lat + q_rope . rope`, runs an online softmax and accumulates `p . lat`.
- Splits write a normalized partial and its base-2 log-sum-exp; paged_decode's merge kernel combines
  them (any `num_splits` is correct for any context, so a CUDA graph may freeze one).

`store_latent` writes a step's new latent rows into their slots (negative slot: a CUDA-graph padding
row, skipped), the latent layout's counterpart of kv_store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import SUPPORTED_DTYPES, check_launch_device
from engine.kernels.paged_decode import LOG2E, MAX_SPLITS, _decode_merge_kernel, dot_dtype_for


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,  # [B, H, C + R] strides (stride_qb, stride_qh, 1)
    cache_ptr,  # [num_blocks, block_size, C + R]: one layer's latent plane; strides (stride_cb, stride_cs, 1)
    block_tables_ptr,  # [B, max_blocks] int32, stride (stride_bt, 1)
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, C] strides (stride_ob, stride_oh, 1); written only when NUM_SPLITS == 1
    mid_o_ptr,  # [B, H, NUM_SPLITS, C] float32 contiguous
    mid_lse_ptr,  # [B, H, NUM_SPLITS] float32 contiguous (-inf = empty split)
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh,
    num_heads,
    latent_dim,  # C
    rope_dim,  # R
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query heads per program (>= 16 for tl.dot)
    BLOCK_C: tl.constexpr,  # next_pow2(C)
    BLOCK_R: tl.constexpr,  # max(16, next_pow2(R))
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = heads < num_heads
    mask_c = offs_c < latent_dim
    mask_r = offs_r < rope_dim
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(DOT_DTYPE)
    q_rope = tl.load(q_rows + latent_dim + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                     other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_C], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        block_ids = tl.load(block_tables_ptr + b * stride_bt + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        rows = cache_ptr + block_ids.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs  # [BLOCK_N]
        lat = tl.load(rows[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        rope = tl.load(rows[:, None] + latent_dim + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :],
                       other=0.0)
        lat = lat.to(DOT_DTYPE)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
        s += tl.dot(q_rope, tl.trans(rope.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), lat, input_precision=DOT_PRECISION)
        m_i = m_new

    has_ctx = l_i > 0.0
    o = acc / tl.where(has_ctx, l_i, 1.0)[:, None]
    out_mask = mask_h[:, None] & mask_c[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (b * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H] (b, head, split)
        tl.store(mid_o_ptr + row[:, None] * latent_dim + offs_c[None, :], o, mask=out_mask)
        lse = tl.where(has_ctx, m_i + tl.log2(tl.where(has_ctx, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _store_latent_kernel(
    src_ptr,  # [T, W] strides (stride_t, 1)
    cache_ptr,  # [num_blocks, block_size, W]: one layer's latent plane; strides (stride_cb, stride_cs, 1)
    slot_ptr,  # [T] int64, < 0 = skip
    stride_t, stride_cb, stride_cs,
    width,
    PAGE_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    offs = tl.arange(0, BLOCK_W)
    # Integer limit rather than a scalar boolean in the mask (see kv_store: the interpreter rejects it).
    mask = offs < tl.where(slot >= 0, width, 0)
    slot = tl.maximum(slot, 0)
    dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    tl.store(dst + offs, tl.load(src_ptr + tok * stride_t + offs, mask=mask), mask=mask)


def latent_layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Validate a latent cache `[num_blocks, num_layers, 1, block_size, 1, C + R]`; layer `layer`'s plane
    as `[num_blocks, block_size, C + R]` (a view: kernels index it with the cache's block stride)."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 1 or kv_cache.shape[4] != 1:
        raise ValueError(f"kv_cache must be a latent cache [num_blocks, num_layers, 1, block_size, 1, C + R], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in SUPPORTED_DTYPES or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be one of {SUPPORTED_DTYPES} with contiguous features, "
                         f"got {kv_cache.dtype} strides {kv_cache.stride()}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for a cache of {kv_cache.shape[1]} layers")
    return kv_cache[:, layer, 0, :, 0]


def store_latent(kv_cache: torch.Tensor, layer: int, entries: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `entries [T, C + R]` into slots `slot_mapping [T]` (int64, negative = skip) of layer `layer`."""
    plane = latent_layer_view(kv_cache, layer)
    width = plane.shape[-1]
    if entries.dim() != 2 or entries.shape[1] != width or entries.stride(1) != 1 or entries.dtype != plane.dtype:
        raise ValueError(f"entries must be [T, {width}] {plane.dtype} with contiguous rows, "
                         f"got {tuple(entries.shape)} {entries.dtype}")
    if slot_mapping.shape != (entries.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [{entries.shape[0]}] int64, got {tuple(slot_mapping.shape)}")
    check_launch_device(_store_latent_kernel, entries=entries, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if entries.shape[0]:
        _store_latent_kernel[(entries.shape[0],)](
            entries, plane, slot_mapping, entries.stride(0), plane.stride(0), plane.stride(1), width,
            PAGE_SIZE=plane.shape[1], BLOCK_W=triton.next_power_of_2(width), num_warps=4)


def mla_decode(
    query: torch.Tensor,  # [B, H, C + R]: W_UK-absorbed latent query, then the rotated rope query
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 1, block_size, 1, C + R]
    layer: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the query token
    scale: float,
    latent_dim: int,  # C
    num_splits: int,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # [B, H, C], query's dtype: attention-weighted latents (W_UV not applied)
    plane = latent_layer_view(kv_cache, layer)
    _check_inputs(query, plane, block_tables, seq_lens, latent_dim)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    batch, num_heads = query.shape[:2]
    rope_dim = plane.shape[-1] - latent_dim
    out = torch.empty((batch, num_heads, latent_dim), dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    mid_shape = (batch, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    mid_o = torch.empty((*mid_shape, latent_dim), dtype=torch.float32, device=query.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=query.device)
    dot_dtype, precision = dot_dtype_for(query.dtype, _mla_decode_split_kernel)
    block_h = max(16, min(block_h, triton.next_power_of_2(num_heads)))
    _mla_decode_split_kernel[(batch, triton.cdiv(num_heads, block_h), num_splits)](
        query, plane, block_tables, seq_lens, out, mid_o, mid_lse, scale * LOG2E,
        query.stride(0), query.stride(1), plane.stride(0), plane.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads, latent_dim, rope_dim,
        PAGE_SIZE=plane.shape[1], NUM_SPLITS=num_splits, BLOCK_H=block_h,
        BLOCK_C=triton.next_power_of_2(latent_dim), BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_N=block_n, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), latent_dim, num_splits,  # seq_lens: unread
            VARLEN=False, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(latent_dim), num_warps=4,
        )
    return out


def _check_inputs(query: torch.Tensor, plane: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  latent_dim: int) -> None:
    width = plane.shape[-1]
    if query.dim() != 3 or query.shape[2] != width or query.stride(-1) != 1 or query.dtype != plane.dtype:
        raise ValueError(f"query must be [B, H, {width}] {plane.dtype} with contiguous features, "
                         f"got {tuple(query.shape)} {query.dtype}")
    if not 16 <= latent_dim < width:
        raise ValueError(f"latent_dim must be in 16..{width - 1}, got {latent_dim}")
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32 \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, max_blocks] int32 with contiguous rows, "
                         f"got {tuple(block_tables.shape)} {block_tables.dtype}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous [{batch}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    check_launch_device(_mla_decode_split_kernel, query=query, kv_cache=plane, block_tables=block_tables,
                        seq_lens=seq_lens)
