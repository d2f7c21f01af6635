"""Fused residual add + RMSNorm: one pass over a row instead of the ~8 torch kernels of the reference.

Returns `(norm(x + residual), x + residual)` exactly as `engine/layers/norm.py` computes them in
torch: the sum is rounded to the activation dtype (torch's add), the mean square and rsqrt are
float32, the normalized row is rounded to the activation dtype before the weight multiply (HF's
LlamaRMSNorm), and the product is rounded once more. One program per row, the whole row in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, N] row stride stride_x
    res_ptr,  # [T, N] row stride stride_r (unused without HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N] contiguous
    sum_ptr,  # [T, N] contiguous: x + residual (unused without HAS_RESIDUAL)
    stride_x,
    stride_r,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, s, mask=mask)
        x = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    h = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rmsnorm(
    x: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N] or None (the first layer: the stream is x itself)
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual) * weight, x + residual)`; without a residual, `(norm(x) * weight, x)`."""
    if x.dim() != 2 or x.stride(-1) != 1 or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"x must be [T, N] with unit column stride and weight [N]; got {tuple(x.shape)}, "
                         f"strides {x.stride()}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    check_launch_device(_add_rmsnorm_kernel, x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    total = x if residual is None else torch.empty_like(out)
    if rows == 0:
        return out, total
    block = triton.next_power_of_2(cols)
    _add_rmsnorm_kernel[(rows,)](
        x, x if residual is None else residual, weight, out, total,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out, total
