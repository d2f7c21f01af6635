"""Fused mixture-of-experts MLP: token slots sorted by expert, then grouped GEMMs over the groups.

The shape of vLLM's and SGLang's fused MoE (our own code):
1. `align_slots_to_experts`: the T*k (token, slot) pairs are sorted by expert and each expert's run is
   padded to a multiple of BLOCK_M with an out-of-range slot id, so every BLOCK_M-row block of the
   sorted order belongs to one expert (`block_experts`). Done with torch ops on the device at sizes
   that depend only on (T, k, E), so it never syncs with the host and can be captured in a CUDA graph.
2. `_grouped_gemm_kernel`, twice: each program computes a BLOCK_M x BLOCK_N tile of one block's rows
   against its expert's weight, gathering input rows through the sorted slot ids and scattering
   output rows back to slot order; padding rows are masked out. First `x @ w13[e]^T` (input row =
   slot // k, the token), then SiLU(gate) * up (engine/kernels/silu_mul.py), then `act @ w2[e]^T`
   (input row = the slot itself). Blocks past the padded total return at once.
The routing-weighted sum over the k slots is the caller's (engine/layers/moe_ops.py), so expert
parallelism can move rows between ranks before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device
from engine.kernels.paged_decode import dot_dtype_for
from engine.kernels.silu_mul import silu_and_mul

BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class ExpertAlignment:
    """Token slots grouped by expert, each group padded to whole blocks of `block_m` rows."""

    sorted_slots: torch.Tensor  # [num_blocks * block_m] int32: slot (t * k + j) per row; num_slots = padding
    block_experts: torch.Tensor  # [num_blocks] int32: the expert of each block (>= E past the end)
    num_padded_rows: torch.Tensor  # [1] int32: rows in use (the sum of the padded group sizes)
    num_slots: int  # T * k
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.shape[0]


def align_slots_to_experts(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the flattened slots of `expert_ids [T, k]` by expert (stable: slot order within a group)."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_slots, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount's output size would need a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank_in_group = torch.arange(num_slots, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    rows = (group_end - padded)[expert_of_sorted] + rank_in_group
    # At most min(E, slots) groups are non-empty, each wasting at most block_m - 1 rows.
    num_blocks = -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[rows] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(group_end, block_start, right=True).to(torch.int32)
    return ExpertAlignment(sorted_slots, block_experts, group_end[-1:].to(torch.int32), num_slots, block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows_a, K]: x [T, H] (a_row_divisor = k) or the activation [T * k, I] (divisor 1)
    b_ptr,  # [E, N, K]: w13 [E, 2I, H] or w2 [E, H, I]
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    c = c_ptr + slots.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, align: ExpertAlignment, a_row_divisor: int) -> torch.Tensor:
    """`[T * k, N]`: row s = `a[s // a_row_divisor] @ weights[expert of s]^T`."""
    if a.stride(-1) != 1 or weights.dim() != 3 or a.shape[1] != weights.shape[2] or a.dtype != weights.dtype:
        raise ValueError(f"need a [rows, K] (unit column stride) and weights [E, N, K] of one dtype, got "
                         f"{tuple(a.shape)} {a.dtype} strides {a.stride()} and {tuple(weights.shape)} {weights.dtype}")
    check_launch_device(_grouped_gemm_kernel, a=a, weights=weights, slots=align.sorted_slots)
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty((align.num_slots, n), dtype=a.dtype, device=a.device)
    if align.num_slots == 0:
        return out
    grid = (align.num_blocks, triton.cdiv(n, BLOCK_N))
    dot_dtype, precision = dot_dtype_for(a.dtype, _grouped_gemm_kernel)
    _grouped_gemm_kernel[grid](
        a, weights, out, align.sorted_slots, align.block_experts, align.num_padded_rows, align.num_slots, n, k,
        a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), a_row_divisor,
        BLOCK_M=align.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=4,
    )
    return out


def block_m_for(num_slots: int, num_experts: int) -> int:
    """Rows per block: 16 when experts see a token or two each (decode), 64 when groups are large
    (prefill), so padding wastes little compute either way."""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def fused_expert_outputs(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [T, k, H]: each slot's expert MLP of its token, unweighted
    tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.shape != (tokens, hidden) or w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, expert_ids {tuple(expert_ids.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    align = align_slots_to_experts(expert_ids, num_experts, block_m_for(tokens * top_k, num_experts))
    gate_up = grouped_gemm(x, w13, align, a_row_divisor=top_k)  # [T * k, 2I]
    return grouped_gemm(silu_and_mul(gate_up), w2, align, a_row_divisor=1).view(tokens, top_k, hidden)
