"""Paged prefill/extend attention over a varlen batch (prefill chunks, with decode rows mixed in).

Sequence `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`: the last `q_len` positions of
its context of `seq_lens[i]` tokens, whose K/V (cached prefix and the new tokens alike) are already in
the paged cache. Query row `t` of the sequence sits at position `seq_len - q_len + t` and attends
causally to keys `0..that position`.

Design (flash attention, varlen, GQA-packed):
- Grid `(T // BLOCK_Q + B, H_kv)`. A tile is `BLOCK_Q` consecutive query tokens of one sequence times
  the G = H_q / H_kv query heads of one KV head: `BLOCK_M = BLOCK_Q * G` rows (row r = token r // G,
  head r % G), so each K/V tile feeds every head of the group. Sequence `i` owns the tile ids
  `query_start_loc[i] // BLOCK_Q + i ...`, at least `ceil(q_len / BLOCK_Q)` of them; a program finds
  its sequence by counting those starts (no host-side tile map, no sync) and exits if its tile is
  past the sequence's queries. Tiles launch last-first: under the causal mask the late tiles of a
  sequence have the most keys, and starting them first shortens the tail of the launch.
- Online softmax (base 2, fp32 state) over key tiles of `BLOCK_N` tokens gathered through the block
  table. Keys before the tile's first query position are visible to every row and run unmasked; only
  the last key tiles (the diagonal) apply the causal mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device, kv_layer_view
from engine.kernels.paged_decode import LOG2E, dot_dtype_for

LARGE_BATCH_ROWS = 4096  # query rows (tokens x GQA group) from which the larger tiles pay off


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr):
    """Index of the sequence owning `tile`: the last i with query_start_loc[i] // BLOCK_Q + i <= tile."""
    offs_b = tl.arange(0, BLOCK_B)
    starts = tl.load(query_start_loc_ptr + offs_b, mask=offs_b < num_seqs, other=0) // BLOCK_Q + offs_b
    owned = (starts <= tile) & (offs_b < num_seqs)
    return tl.sum(owned.to(tl.int32), axis=0) - 1


@triton.jit
def _attend_key_tile(
    q, m_i, l_i, acc, kv_base, block_table_row, n0, kv_end, pos, offs_d, mask_d,
    qk_scale, stride_cb, stride_ckv, stride_cs,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0..n0+BLOCK_N; CAUSAL masks keys past each row's position."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < kv_end
    block_ids = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    rows = block_ids.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs  # [BLOCK_N]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(kv_base + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(kv_base + stride_ckv + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Integers that change from step to step are not specialised on (Triton would compile a variant for
# each of ==1 / multiple of 16 / other, ~1 s each, while serving): the block table's width and the
# sequence count. What still varies (BLOCK_B, the tile shape) is compiled by `warm_up` at start.
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    q_ptr,  # [T, H_q, D] strides (stride_qt, stride_qh, 1)
    cache_ptr,  # [num_blocks, 2, block_size, H_kv, D]: one layer of the cache, [:, 0] = K, [:, 1] = V;
    #             strides (stride_cb, stride_ckv, stride_cs, stride_ch, 1)
    block_tables_ptr,  # [B, max_blocks] int32, strides (stride_bt, 1)
    seq_lens_ptr,  # [B] int32: context length after this step
    query_start_loc_ptr,  # [B + 1] int32: cumulative query lengths
    out_ptr,  # [T, H_q, D] strides (stride_ot, stride_oh, 1)
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    head_dim,
    num_seqs,
    PAGE_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # G = H_q // H_kv
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_Q * G <= BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per tile (power of two)
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # next_pow2(D)
    BLOCK_B: tl.constexpr,  # next_pow2(B)
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last tiles (most keys, causal) launch first
    kvh = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q, BLOCK_B)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # tile's first query token, in the sequence
    if first_tok >= q_len:
        return
    ctx_start = tl.load(seq_lens_ptr + seq) - q_len  # position of query token 0

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = first_tok + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    mask_m = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    mask_d = offs_d < head_dim
    q_rows = (q_start + tok).to(tl.int64)
    io_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0).to(DOT_DTYPE)
    pos = ctx_start + tok  # [BLOCK_M] absolute position of each row

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = ctx_start + tl.minimum(first_tok + BLOCK_Q, q_len)  # one past the tile's last position
    full_end = ((ctx_start + first_tok) // BLOCK_N) * BLOCK_N  # keys below it are visible to all rows
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, kv_base, bt_row, n0, kv_end, pos, offs_d, mask_d,
            qk_scale, stride_cb, stride_ckv, stride_cs,
            PAGE_SIZE, BLOCK_N, False, DOT_DTYPE, DOT_PRECISION,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, kv_base, bt_row, n0, kv_end, pos, offs_d, mask_d,
            qk_scale, stride_cb, stride_ckv, stride_cs,
            PAGE_SIZE, BLOCK_N, True, DOT_DTYPE, DOT_PRECISION,
        )
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    query: torch.Tensor,  # [T, H_q, D]
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
    layer: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H_q, D], same dtype as query
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context (cached + new).

    Tiles default by batch size, known on the host: 128 rows x 8 warps for large batches of new
    tokens (long prompts: matrix-bound), 64 x 4 for small ones (decode-heavy mixes waste fewer rows).
    """
    cache = kv_layer_view(kv_cache, layer)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    num_seqs = _check_prefill_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc, num_kv_heads)
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} with contiguous head_dim")
    num_tokens, num_q_heads = query.shape[0], query.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    large = num_tokens * group >= LARGE_BATCH_ROWS
    block_m = max(block_m or (128 if large else 64), triton.next_power_of_2(group))
    num_warps = num_warps or (8 if large else 4)
    if block_m & (block_m - 1) or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {block_m}, {block_n}")
    block_q = block_m // group
    dot_dtype, precision = dot_dtype_for(query.dtype, _prefill_kernel)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        head_dim, num_seqs,
        PAGE_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_B=max(16, triton.next_power_of_2(num_seqs)),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Compile every kernel variant a step can need, before serving: each sequence-count bucket
    (BLOCK_B = 16 .. next_pow2(max_num_seqs)) with both tile shapes. Reads the cache, writes nothing
    to it. Returns the number of launches (one compile each, the first time in a process)."""
    head_dim, device = kv_cache.shape[-1], kv_cache.device
    buckets = [16 << i for i in range(max(triton.next_power_of_2(max_num_seqs), 16).bit_length() - 4)]
    launches = 0
    for bucket in buckets:
        num_seqs = bucket // 2 + 1 if bucket > 16 else 1
        query = torch.zeros((num_seqs, num_q_heads, head_dim), dtype=dtype, device=device)
        tables = torch.zeros((num_seqs, 1), dtype=torch.int32, device=device)
        lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        for block_m, warps in ((None, None), (128, 8)):  # the small and the large tile shape
            paged_prefill(query, kv_cache, 0, tables, lens, starts, 1.0, block_m=block_m, num_warps=warps)
            launches += 1
    return launches


def _check_prefill_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_kv_heads: int,
) -> int:
    head_dim = kv_cache.shape[-1]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query must be [T, k * {num_kv_heads}, {head_dim}], got {tuple(query.shape)}")
    if query.dtype != kv_cache.dtype or query.stride(-1) != 1:
        raise ValueError(
            f"query must be {kv_cache.dtype} (the cache dtype) with contiguous head_dim, "
            f"got {query.dtype} strides {query.stride()}"
        )
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if num_seqs < 0 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens must be contiguous [B] int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}"
        )
    if tuple(query_start_loc.shape) != (num_seqs + 1,) or query_start_loc.dtype != torch.int32 \
            or not query_start_loc.is_contiguous():
        raise ValueError(f"query_start_loc must be contiguous [{num_seqs + 1}] int32, got "
                         f"{tuple(query_start_loc.shape)} {query_start_loc.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32 \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] int32 with contiguous rows, got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype} strides {block_tables.stride()}")
    check_launch_device(_prefill_kernel, query=query, kv_cache=kv_cache, block_tables=block_tables,
                        seq_lens=seq_lens, query_start_loc=query_start_loc)
    return num_seqs
