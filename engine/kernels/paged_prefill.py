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
  table. Keys before the tile's first query position are visible to every row and run with no mask at
  all; only the last key tiles (the diagonal) apply the causal mask. The score scale is folded into the
  exponent's multiply-add (exp2), and the launch config (tile shape, warps, pipelining stages, optional
  warp specialization of the off-diagonal loop) comes from attention_tiles.PREFILL_TABLE.
- Decode rows of a mixed step (sequences with one query row): with INLINE_DECODE_ROWS their one tile
  runs the decode kernel's loop (the GQA group padded to 16 rows) instead of a BLOCK_M-row tile of
  padding; with SKIP_DECODE_ROWS they are left to the decode kernel (paged_mixed.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention_tiles import (
    MIXED_DECODE_ROWS,
    PREFILL_TABLE,
    DecodeRows,
    PrefillConfig,
    PrefillRows,
    prefill_config,
)
from engine.kernels.kv_store import check_activation_dtype, check_launch_device, kv_layer_view
from engine.kernels.paged_decode import LOG2E, attend_decode_row, dot_dtype_for, store_decode_row
from engine.kernels.paged_kv_tile import kv_tile_rows, load_kv_tile


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
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0..n0+BLOCK_N; CAUSAL masks keys past each row's position.

    `m_i` is kept in scaled (log2) units, so the scale folds into the exponent's multiply-add and the
    [BLOCK_M, BLOCK_N] scores are never rescaled on their own. Off-diagonal tiles (not CAUSAL) are
    whole: every key is below `kv_end`, so they need no mask at all.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if CAUSAL:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        mask_n = offs_n < kv_end
    else:
        mask_n = tl.full([BLOCK_N], True, tl.int1)  # a constant mask: the compiler drops it
    rows = kv_tile_rows(block_table_row, offs_n, mask_n, stride_cb, stride_cs, PAGE_SIZE)
    k = load_kv_tile(kv_base, rows, offs_d, mask_n, mask_d, DOT_DTYPE, EVEN_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_kv_tile(kv_base + stride_ckv, rows, offs_d, mask_n, mask_d, DOT_DTYPE, EVEN_D)
    acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
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
    EVEN_D: tl.constexpr,  # head_dim == BLOCK_D
    BLOCK_B: tl.constexpr,  # next_pow2(B)
    SKIP_DECODE_ROWS: tl.constexpr,  # leave sequences with q_len == 1 to the decode kernel (mixed steps)
    INLINE_DECODE_ROWS: tl.constexpr,  # attend sequences with q_len == 1 with a decode tile (BLOCK_G rows)
    BLOCK_G: tl.constexpr,  # max(16, next_pow2(G)): the decode tile's rows
    WARP_SPECIALIZE: tl.constexpr,  # Triton's automatic warp specialization of the off-diagonal loop
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
    if SKIP_DECODE_ROWS:  # noqa: SIM102 - a constexpr test around a runtime one
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # position of query token 0
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if INLINE_DECODE_ROWS:  # noqa: SIM102 - a constexpr test around a runtime one
        if q_len == 1:  # a decode row: its G heads alone, not a BLOCK_M-row tile of padding
            m_d, l_d, acc_d = attend_decode_row(
                q_ptr + q_start.to(tl.int64) * stride_qt, stride_qh, kv_base, bt_row, 0, seq_len, kvh, head_dim,
                qk_scale, stride_cb, stride_ckv, stride_cs, PAGE_SIZE, GROUP, BLOCK_G, BLOCK_D, EVEN_D, BLOCK_N,
                DOT_DTYPE, DOT_PRECISION,
            )
            store_decode_row(out_ptr + q_start.to(tl.int64) * stride_ot, stride_oh, kvh, acc_d, l_d, head_dim,
                             GROUP, BLOCK_G, BLOCK_D)
            return

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
    kv_end = ctx_start + tl.minimum(first_tok + BLOCK_Q, q_len)  # one past the tile's last position
    full_end = ((ctx_start + first_tok) // BLOCK_N) * BLOCK_N  # keys below it are visible to all rows
    for n0 in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, kv_base, bt_row, n0, kv_end, pos, offs_d, mask_d,
            qk_scale, stride_cb, stride_ckv, stride_cs,
            PAGE_SIZE, BLOCK_N, False, EVEN_D, DOT_DTYPE, DOT_PRECISION,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: at most ceil(BLOCK_Q / BLOCK_N) + 1 tiles
        m_i, l_i, acc = _attend_key_tile(
            q, m_i, l_i, acc, kv_base, bt_row, n0, kv_end, pos, offs_d, mask_d,
            qk_scale, stride_cb, stride_ckv, stride_cs,
            PAGE_SIZE, BLOCK_N, True, EVEN_D, DOT_DTYPE, DOT_PRECISION,
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
    config: PrefillConfig | None = None,
    decode_rows: DecodeRows = DecodeRows.INLINE,
) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context (cached + new).

    `config` defaults by the step's query rows, known on the host (attention_tiles.PREFILL_TABLE).
    `decode_rows` says how sequences with a single query row are attended (attention_tiles.DecodeRows);
    with DECODE_KERNEL their rows are left unwritten, for `paged_decode(..., query_start_loc=...)` to
    attend (engine/kernels/paged_mixed.py).
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
    config = config or prefill_config(num_tokens, group)
    # The tables are tuned for 2-byte activations; 4-byte tiles of 128 keys overflow Hopper's shared memory
    # (float32 runs are the correctness checks), so they take 64 keys.
    block_n = config.block_n if query.element_size() <= 2 else min(config.block_n, 64)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    if block_m & (block_m - 1) or block_n & (block_n - 1) or block_n < 16:
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {block_m}, {block_n}")
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    dot_dtype, precision = dot_dtype_for(query.dtype, _prefill_kernel)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2E,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        head_dim, num_seqs,
        PAGE_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, EVEN_D=head_dim == block_d, BLOCK_B=max(16, triton.next_power_of_2(num_seqs)),
        SKIP_DECODE_ROWS=decode_rows == DecodeRows.DECODE_KERNEL, INLINE_DECODE_ROWS=decode_rows == DecodeRows.INLINE,
        BLOCK_G=max(16, triton.next_power_of_2(group)), WARP_SPECIALIZE=config.warp_specialize,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Compile every kernel variant a step can need, before serving: each sequence-count bucket
    (BLOCK_B = 16 .. next_pow2(max_num_seqs)) with each default tile shape, for steps without decode
    rows (PREFILL_TILES) and for mixed steps (MIXED_DECODE_ROWS). Reads the cache, writes nothing to
    it. Returns the number of launches (one compile each, the first time in a process)."""
    head_dim, device = kv_cache.shape[-1], kv_cache.device
    buckets = [16 << i for i in range(max(triton.next_power_of_2(max_num_seqs), 16).bit_length() - 4)]
    launches = 0
    for bucket in buckets:
        num_seqs = bucket // 2 + 1 if bucket > 16 else 1
        query = torch.zeros((num_seqs, num_q_heads, head_dim), dtype=dtype, device=device)
        tables = torch.zeros((num_seqs, 1), dtype=torch.int32, device=device)
        lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        for rows in PrefillRows:
            for mode in (DecodeRows.PREFILL_TILES, MIXED_DECODE_ROWS):
                paged_prefill(query, kv_cache, 0, tables, lens, starts, 1.0, config=PREFILL_TABLE[rows],
                              decode_rows=mode)
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
    check_activation_dtype("query", query.dtype, kv_cache.dtype)  # an FP8 cache: K/V tiles cast to DOT_DTYPE
    if query.stride(-1) != 1:
        raise ValueError(f"query head_dim must be contiguous, got strides {query.stride()}")
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
