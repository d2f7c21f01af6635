"""Per-head RMSNorm (Qwen3's q/k norm) as one Triton kernel over a strided `[T, H, D]` view.

The torch reference (`RMSNorm.normalize`, engine/layers/norm.py) launches seven small kernels per
call, twice per layer: in a batch-1 decode step of a 48-layer model that is ~670 launches for a
few kilobytes. Here q or k is read in place from the QKV projection's output (any token and head
stride, unit stride within a head), one program per (token, head), with the reference's rounding:
mean square and rsqrt in float32, the normalized row rounded to the activation dtype before the
weight multiply (HF's Qwen3RMSNorm), the product rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device


@triton.jit
def _rmsnorm_heads_kernel(
    x_ptr,  # [T, H, D] strides (stride_t, stride_h, 1)
    w_ptr,  # [D]
    out_ptr,  # [T, H, D] contiguous
    heads,
    stride_t,
    stride_h,
    head_dim,
    eps,
    BLOCK: tl.constexpr,  # next power of two >= D
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    x = tl.load(x_ptr + token * stride_t + head * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    h = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * head_dim + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`[T, H, D] -> [T, H, D]` contiguous: each head's row normalized, times `weight [D]`."""
    if x.dim() != 3 or x.stride(-1) != 1 or tuple(weight.shape) != (x.shape[2],):
        raise ValueError(f"x must be [T, H, D] with unit last stride and weight [D]; got {tuple(x.shape)}, "
                         f"strides {x.stride()}, weight {tuple(weight.shape)}")
    check_launch_device(_rmsnorm_heads_kernel, x=x, weight=weight)
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if tokens and heads:
        _rmsnorm_heads_kernel[(tokens * heads,)](x, weight, out, heads, x.stride(0), x.stride(1), head_dim, eps,
                                                 BLOCK=triton.next_power_of_2(head_dim), num_warps=1)
    return out
