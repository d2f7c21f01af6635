"""Fused mixture-of-experts MLP: token slots sorted by expert, then grouped GEMMs over the groups.

The shape of vLLM's and SGLang's fused MoE (our own code):
1. `align_slots_to_experts` (engine/kernels/moe_align.py): the T*k (token, slot) pairs grouped by
   expert, each group padded to whole blocks of `block_m` rows, so every block belongs to one expert.
2. `_grouped_gemm_kernel`, twice: each program computes a BLOCK_M x BLOCK_N tile of one block's rows
   against its expert's weight, gathering input rows through the sorted slot ids and scattering
   output rows back to slot order; padding rows are masked out, and blocks past the padded total
   return at once. First `x @ w13[e]^T` (input row = slot // k, the token) with SiLU(gate) * up in
   the epilogue (FUSE_SILU: each program holds the gate tile and the matching up tile, so the
   [T*k, 2I] intermediate is never written), then `act @ w2[e]^T` (input row = the slot itself).
Tile shapes, warps and pipeline stages come from engine/kernels/fused_moe_configs.py by rows per
expert (decode-like or prefill-like) and shape.

FP8 experts (weights e4m3, activations in their own dtype): each weight tile is widened to the
activations' dtype in registers (exact: every e4m3 value is a bf16 value) and multiplied on the
16-bit tensor cores, the dequantization scales applied to the float32 sums -- weight-only, the design
of the small-M FP8 GEMM (engine/kernels/fp8_weight_gemm.py). A decode step reads each routed expert's
bytes once, so it is there that FP8 halves the time; no activation quantization is launched at all.
Scales are dequantization scales (`real = fp8 * scale`), per expert, in one of two layouts:
- per output row: `w13_scale [E, 2I]` (gate rows, then up rows), `w2_scale [E, H]`, applied once to
  each output column after the K loop;
- 128 x 128 blocks: `w13_scale [E, 2 * ceil(I/128), ceil(H/128)]` (the gate's blocks, then the up's:
  a checkpoint scales the two projections separately, so an I that is not a multiple of 128 does not
  mix them), `w2_scale [E, ceil(H/128), ceil(I/128)]`; K is walked in tiles of at most 128 that never
  straddle a scale block, each tile's partial sum scaled by its block's scale (vLLM's and SGLang's
  block-FP8 fused MoE scale the same way, over an FP8 x FP8 product of per-token-group quantized
  activations; for prefill-sized M that is what would reach the FP8 tensor-core rate, not built yet).

The routing-weighted sum over the k slots is the caller's (engine/layers/moe_ops.py), so expert
parallelism can move rows between ranks before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.fused_moe_configs import GemmTile, MoeKernelConfig, config_for
from engine.kernels.kv_store import check_launch_device
from engine.kernels.moe_align import ExpertAlignment, align_slots_to_experts
from engine.kernels.paged_decode import dot_dtype_for

__all__ = ["ExpertAlignment", "align_slots_to_experts", "fused_expert_outputs", "grouped_gemm"]


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows_a, K]: x [T, H] (a_row_divisor = k) or the activation [T * k, I] (divisor 1)
    b_ptr,  # [E, N, K] (w2 [E, H, I]), or [E, 2N, K] with FUSE_SILU (w13 [E, 2I, H]: gate rows, then up rows)
    c_ptr,  # [T * k, N] contiguous, slot order
    sorted_slots_ptr,  # [num_blocks * BLOCK_M] int32
    block_experts_ptr,  # [num_blocks] int32
    num_padded_rows_ptr,  # [1] int32
    num_slots,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    a_row_divisor,
    s_ptr,  # FP8 scales (module docstring): [E, N_total] per row, [E, N_blocks, K_blocks] per block; else unused
    stride_se,
    stride_sn,
    up_scale_offset,  # FUSE_SILU: scale row (per-row) or scale block row (blocks) where the up projection's start
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALING: tl.constexpr,  # 0: weights in a's dtype; 1: e4m3, per-row scales; 2: e4m3, 128 x 128 block scales
    FUSE_SILU: tl.constexpr,  # c = silu(a @ gate^T) * (a @ up^T), each rounded to c's dtype as the torch path does
    DOT_DTYPE: tl.constexpr,  # operand type of tl.dot: the input dtype (fp32 only under the interpreter)
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_rows_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    a_rows = (slots // a_row_divisor).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scales = s_ptr + expert * stride_se
    n_safe = tl.where(n_ok, offs_n, 0)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALING == 2:  # this K tile lies in one scale block: scale its partial sums
            scale = tl.load(scales + (n_safe // 128) * stride_sn + k0 // 128)
            acc += tl.dot(a, b.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale[None, :]
        else:
            acc += tl.dot(a, b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if FUSE_SILU:
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if SCALING == 2:
                scale_up = tl.load(scales + (up_scale_offset + n_safe // 128) * stride_sn + k0 // 128)
                acc_up += tl.dot(a, up.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale_up[None, :]
            else:
                acc_up += tl.dot(a, up.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if SCALING == 1:
        acc *= tl.load(scales + n_safe * stride_sn)[None, :]
        if FUSE_SILU:
            acc_up *= tl.load(scales + (up_scale_offset + n_safe) * stride_sn)[None, :]
    out_dtype = c_ptr.dtype.element_ty
    if FUSE_SILU:
        gate = acc.to(out_dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        acc = silu * acc_up.to(out_dtype).to(tl.float32)
    c = c_ptr + slots.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(out_dtype), mask=row_ok[:, None] & n_ok[None, :])


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, align: ExpertAlignment, a_row_divisor: int, tile: GemmTile,
                 fuse_silu: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`[T * k, N]`: row s = `a[s // a_row_divisor] @ weights[expert of s]^T`; with `fuse_silu`,
    weights are `[E, 2N, K]` and row s = silu(a_s @ gate^T) * (a_s @ up^T). With `scale`, the
    weights are e4m3 and `scale` their dequantization scales (module docstring: per row or per block)."""
    if a.stride(-1) != 1 or weights.dim() != 3 or a.shape[1] != weights.shape[2]:
        raise ValueError(f"need a [rows, K] (unit column stride) and weights [E, N, K], got "
                         f"{tuple(a.shape)} strides {a.stride()} and {tuple(weights.shape)}")
    if weights.stride(-1) != 1 or (fuse_silu and weights.shape[1] % 2):
        raise ValueError(f"weights need a unit last stride (and an even N to fuse SiLU), got "
                         f"{tuple(weights.shape)} strides {weights.stride()}")
    n = weights.shape[1] // 2 if fuse_silu else weights.shape[1]
    k = weights.shape[2]
    layout = _scale_layout(a, weights, scale, n, fuse_silu)
    scales = weights if scale is None else scale  # never read without scales
    check_launch_device(_grouped_gemm_kernel, a=a, weights=weights, slots=align.sorted_slots, scales=scales)
    block_k = min(tile.block_k, SCALE_BLOCK) if layout.scaling == BLOCK_SCALED else tile.block_k
    if SCALE_BLOCK % block_k and layout.scaling == BLOCK_SCALED:  # a K tile must lie in one scale block
        raise ValueError(f"block_k {tile.block_k} does not divide {SCALE_BLOCK}: block-scaled weights need it")
    out = torch.empty((align.num_slots, n), dtype=a.dtype, device=a.device)
    if align.num_slots == 0:
        return out
    grid = (align.num_blocks, triton.cdiv(n, tile.block_n))
    dot_dtype, precision = dot_dtype_for(a.dtype, _grouped_gemm_kernel)
    _grouped_gemm_kernel[grid](
        a, weights, out, align.sorted_slots, align.block_experts, align.num_padded_rows, align.num_slots, n, k,
        a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), a_row_divisor,
        scales, layout.stride_expert, layout.stride_row, layout.up_offset,
        BLOCK_M=align.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, SCALING=layout.scaling, FUSE_SILU=fuse_silu,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out


# The kernel's SCALING values.
UNSCALED, ROW_SCALED, BLOCK_SCALED = 0, 1, 2
SCALE_BLOCK = 128  # the block edge of block-scaled FP8 weights


@dataclass(frozen=True)
class _ScaleLayout:
    scaling: int  # UNSCALED, ROW_SCALED or BLOCK_SCALED
    stride_expert: int = 0
    stride_row: int = 0
    up_offset: int = 0  # the up projection's first scale row (per-row) or scale block row (blocks)


def _scale_layout(a: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor | None, n: int,
                  fuse_silu: bool) -> _ScaleLayout:
    """How the kernel reads `scale` for `weights`; ValueError when they do not fit each other."""
    if scale is None:
        if a.dtype != weights.dtype:
            raise ValueError(f"unscaled weights must have the activations' dtype {a.dtype}, got {weights.dtype}")
        return _ScaleLayout(UNSCALED)
    if weights.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(f"scaled weights must be float8_e4m3fn with float32 scales of unit last stride, got "
                         f"{weights.dtype} and {scale.dtype} strides {scale.stride()}")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"activations must be bf16, fp16 or fp32 for FP8 experts, got {a.dtype}")
    experts, rows, k = weights.shape
    if scale.dim() == 2 and tuple(scale.shape) == (experts, rows):
        return _ScaleLayout(ROW_SCALED, scale.stride(0), 1, n)
    n_blocks, k_blocks = -(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)
    want_rows = 2 * n_blocks if fuse_silu else n_blocks
    if scale.dim() == 3 and scale.shape[:2] == (experts, want_rows) and scale.shape[2] >= k_blocks:
        return _ScaleLayout(BLOCK_SCALED, scale.stride(0), scale.stride(1), n_blocks)
    raise ValueError(f"scale must be [{experts}, {rows}] (per row) or [{experts}, {want_rows}, >= {k_blocks}] "
                     f"(128 x 128 blocks) for weights {tuple(weights.shape)}, got {tuple(scale.shape)}")


def fused_expert_outputs(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H] in x's dtype, or e4m3 with w13_scale
    w2: torch.Tensor,  # [E, H, I] in x's dtype, or e4m3 with w2_scale
    config: MoeKernelConfig | None = None,  # None: the table's entry for this shape
    w13_scale: torch.Tensor | None = None,  # FP8: [E, 2I] per row or [E, 2 * ceil(I/128), ceil(H/128)] blocks
    w2_scale: torch.Tensor | None = None,  # FP8: [E, H] per row or [E, ceil(H/128), ceil(I/128)] blocks
) -> torch.Tensor:  # [T, k, H]: each slot's expert MLP of its token, unweighted
    tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.shape != (tokens, hidden) or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    config = config or config_for(tokens * top_k, num_experts, hidden, two_i // 2)
    align = align_slots_to_experts(expert_ids, num_experts, config.block_m)
    act = grouped_gemm(x, w13, align, top_k, config.gate_up, fuse_silu=True, scale=w13_scale)  # [T * k, I]
    return grouped_gemm(act, w2, align, 1, config.down, scale=w2_scale).view(tokens, top_k, hidden)
