"""Paged decode attention: one query token per sequence over its paged context, split-KV, GQA.

Design (flash-decoding):
- Grid `(B, H_kv, num_splits)`. A program owns one sequence, one KV head and one contiguous chunk of
  the context. It loads the G = H_q / H_kv query heads of that KV head's group as one [G, D] tile
  (rows padded to 16 for `tl.dot`), so each K/V tile is read from memory once per group, not once per
  query head.
- The context of `seq_len` tokens is cut into `num_splits` chunks of `ceil(seq_len / num_splits)`
  tokens rounded up to `BLOCK_N`. Each program runs an online softmax over its chunk in tiles of
  `BLOCK_N` tokens, gathering each token's row through the block table (a tile may span pages, and
  any block size works), and writes a partial result: the normalized accumulator and its log-sum-exp
  (base 2). A second kernel, grid `(B, H_q)`, merges the splits. With one split the first kernel
  writes the output directly and no merge runs.
- `num_splits` is a launch parameter, not derived from the data on the device: any value is correct
  for any `seq_lens`, so a CUDA graph can capture a fixed one and replay it as contexts grow.
  Splits that get no tokens (short sequences, or padded rows with `seq_len == 0`) write an empty
  partial (lse = -inf) that the merge ignores; a row with no context at all gets zeros. The split
  count and the tile shape come from the shape class of the step (engine/kernels/attention_tiles.py).
- Varlen mode (`query_start_loc` given): the decode rows of a mixed prefill + decode step, attended
  here while the prefill kernel skips them, so no decode row pads a whole prefill tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_tiles import MAX_SPLITS, decode_config
from engine.kernels.kv_store import check_activation_dtype, check_launch_device, is_interpreted, kv_layer_view
from engine.kernels.paged_kv_tile import kv_tile_rows, load_kv_tile

LOG2E = 1.4426950408889634
__all__ = ["LOG2E", "MAX_SPLITS", "choose_num_splits", "dot_dtype_for", "paged_decode"]


# The split count is a runtime argument (one compile serves every count); SPLIT says whether there is more
# than one (partials + merge) or one (direct output).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [T, H_q, D] strides (stride_qb, stride_qh, 1); T = B unless VARLEN
    cache_ptr,  # [num_blocks, 2, block_size, H_kv, D]: one layer of the cache, [:, 0] = K, [:, 1] = V;
    #             strides (stride_cb, stride_ckv, stride_cs, stride_ch, 1)
    block_tables_ptr,  # [B, max_blocks] int32, stride (stride_bt, 1)
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32 cumulative query lengths; read only when VARLEN
    out_ptr,  # [T, H_q, D] strides (stride_ob, stride_oh, 1); written only when not SPLIT
    mid_o_ptr,  # [B, H_q, num_splits, D] float32 contiguous: each split's normalized accumulator
    mid_lse_ptr,  # [B, H_q, num_splits] float32 contiguous: each split's log2-sum-exp2 (-inf = empty)
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    head_dim,
    num_splits,
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # G = H_q // H_kv
    SPLIT: tl.constexpr,  # num_splits > 1
    VARLEN: tl.constexpr,  # query rows located by query_start_loc; sequences whose q_len != 1 are skipped
    BLOCK_G: tl.constexpr,  # max(16, next_pow2(G))
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D
    BLOCK_N: tl.constexpr,  # context tokens per tile
    DOT_DTYPE: tl.constexpr,  # operand type of tl.dot: the input dtype (fp32 only under the interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands, else ignored
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = b
    if VARLEN:
        q_row = tl.load(query_start_loc_ptr + b).to(tl.int64)
        if tl.load(query_start_loc_ptr + b + 1) - q_row != 1:
            return  # a prefill row: the prefill kernel owns it
    seq_len = tl.load(seq_lens_ptr + b)
    # ceil(seq_len / num_splits) rounded up to whole tiles (plain integer math, not tl.cdiv: a jitted
    # library function, which the interpreter cannot call unless triton itself was imported interpreted)
    split_len = ((seq_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    k_base = cache_ptr + kvh * stride_ch
    bt_row = block_tables_ptr + b * stride_bt
    m_i, l_i, acc = attend_decode_row(
        q_ptr + q_row * stride_qb, stride_qh, k_base, bt_row, start, end, kvh, head_dim, qk_scale,
        stride_cb, stride_ckv, stride_cs, PAGE_SIZE, GROUP, BLOCK_G, BLOCK_D, EVEN_D, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )
    if SPLIT:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask_g = offs_g < GROUP
        has_ctx = l_i > 0.0
        o = acc / tl.where(has_ctx, l_i, 1.0)[:, None]
        row = (b * tl.num_programs(1) * GROUP + kvh * GROUP + offs_g) * num_splits + split  # (b, head, split)
        out_mask = mask_g[:, None] & (offs_d < head_dim)[None, :]
        tl.store(mid_o_ptr + row[:, None] * head_dim + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(has_ctx, m_i + tl.log2(tl.where(has_ctx, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=mask_g)
    else:
        store_decode_row(out_ptr + q_row * stride_ob, stride_oh, kvh, acc, l_i, head_dim, GROUP, BLOCK_G, BLOCK_D)


@triton.jit
def attend_decode_row(
    q_row_ptr, stride_qh, kv_base, bt_row, start, end, kvh, head_dim, qk_scale,
    stride_cb, stride_ckv, stride_cs,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of one query token's GQA group (rows padded to BLOCK_G) over context positions
    start..end of one KV head: (m, l, acc), m in scaled log2 units, acc not yet normalized. Shared by
    the decode kernel and the prefill kernel's inline decode rows."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_row_ptr + (kvh * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = kv_tile_rows(bt_row, offs_n, mask_n, stride_cb, stride_cs, PAGE_SIZE)
        k = load_kv_tile(kv_base, rows, offs_d, mask_n, mask_d, DOT_DTYPE, EVEN_D)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N], unscaled
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])  # the scale folds into one multiply-add
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_kv_tile(kv_base + stride_ckv, rows, offs_d, mask_n, mask_d, DOT_DTYPE, EVEN_D)
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_decode_row(out_row_ptr, stride_oh, kvh, acc, l_i, head_dim, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Normalize and store one token's GQA group; a row with no context gets zeros."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_row_ptr + (kvh * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
             o.to(out_row_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & (offs_d < head_dim)[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_o_ptr,  # [B, H_q, num_splits, D] float32 contiguous
    mid_lse_ptr,  # [B, H_q, num_splits] float32 contiguous
    query_start_loc_ptr,  # [B + 1] int32; read only when VARLEN
    out_ptr,  # [T, H_q, D] strides (stride_ob, stride_oh, 1)
    stride_ob,
    stride_oh,
    head_dim,
    num_splits,
    VARLEN: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_pow2(num_splits)
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    q_row = b
    if VARLEN:
        q_row = tl.load(query_start_loc_ptr + b).to(tl.int64)
        if tl.load(query_start_loc_ptr + b + 1) - q_row != 1:
            return
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < head_dim
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    w_sum = tl.sum(w, axis=0)
    w = w / tl.where(w_sum > 0.0, w_sum, 1.0)
    o = tl.load(
        mid_o_ptr + (row * num_splits + offs_s)[:, None] * head_dim + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :] & (lse > float("-inf"))[:, None],
        other=0.0,
    )
    o = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + q_row * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_splits(
    batch_size: int, num_kv_heads: int, num_sms: int, max_seq_len: int | None = None
) -> int:
    """Splits per (sequence, KV head) under the default config of this shape (attention_tiles.py).

    With `max_seq_len` given, splits are capped so each gets at least the config's
    `min_split_tokens`; leave it out for a value that depends on the batch shape alone (CUDA-graph
    capture).
    """
    config = decode_config(batch_size, num_kv_heads, num_sms, max_seq_len)
    return config.num_splits(batch_size, num_kv_heads, num_sms, max_seq_len)


def dot_dtype_for(dtype: torch.dtype, kernel: object) -> tuple[tl.dtype, str]:
    """Operand dtype and precision of `tl.dot`.

    On the GPU the operands keep the input dtype (tensor cores, fp32 accumulation); fp32 inputs use
    exact "ieee" products rather than tf32. Triton's CPU interpreter computes bf16 arithmetic on the
    raw 16-bit patterns (wrong results; seen in triton 3.4 through 3.9), so there bf16 operands are
    widened to fp32: the interpreter tests cover bf16 loads, stores and casts but not bf16 `tl.dot`.
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted(kernel)):
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


def paged_decode(
    query: torch.Tensor,  # [B, H_q, D]; [T, H_q, D] with query_start_loc
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
    layer: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including the query token
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # same shape and dtype as query
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    query_start_loc: torch.Tensor | None = None,  # [B + 1] int32: a varlen (mixed) batch
) -> torch.Tensor:
    """Attention of each sequence's single query token (its last position) over its whole context.

    With `query_start_loc`, `query` holds a mixed step's rows: only the sequences with exactly one
    query row are attended (and only their rows of `out` written); the others are the prefill
    kernel's (`paged_prefill(..., decode_rows=DecodeRows.DECODE_KERNEL)`).
    """
    cache = kv_layer_view(kv_cache, layer)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    batch, num_q_heads = _check_decode_inputs(
        query, kv_cache, block_tables, seq_lens, query_start_loc, num_kv_heads, head_dim
    )
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with contiguous head_dim")
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    mid_shape = (batch, num_q_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    mid_o = torch.empty((*mid_shape, head_dim), dtype=torch.float32, device=query.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=query.device)
    starts = seq_lens if query_start_loc is None else query_start_loc  # a placeholder when not VARLEN
    dot_dtype, precision = dot_dtype_for(query.dtype, _decode_split_kernel)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, cache, block_tables, seq_lens, starts, out, mid_o, mid_lse, scale * LOG2E,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        head_dim, num_splits,
        PAGE_SIZE=block_size, GROUP=group, SPLIT=num_splits > 1, VARLEN=query_start_loc is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, EVEN_D=head_dim == block_d,
        BLOCK_N=block_n, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            mid_o, mid_lse, starts, out, out.stride(0), out.stride(1), head_dim, num_splits,
            VARLEN=query_start_loc is not None, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out


def _check_decode_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[int, int]:
    """(B, H_q) after checking every input; B is the sequence count (seq_lens)."""
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [B, H_q, {head_dim}], got {tuple(query.shape)}")
    batch = query.shape[0] if query_start_loc is None else seq_lens.shape[0]
    num_q_heads = query.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"H_q ({num_q_heads}) must be a multiple of H_kv ({num_kv_heads})")
    check_activation_dtype("query", query.dtype, kv_cache.dtype)  # an FP8 cache: K/V tiles cast to DOT_DTYPE
    if query.stride(-1) != 1:
        raise ValueError(f"query head_dim must be contiguous, got strides {query.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [{batch}, max_blocks] int32, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if tuple(seq_lens.shape) != (batch,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens must be contiguous [{batch}] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if query_start_loc is not None and (tuple(query_start_loc.shape) != (batch + 1,)
                                        or query_start_loc.dtype != torch.int32
                                        or not query_start_loc.is_contiguous()):
        raise ValueError(f"query_start_loc must be contiguous [{batch + 1}] int32, got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    check_launch_device(
        _decode_split_kernel, query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens
    )
    return batch, num_q_heads
