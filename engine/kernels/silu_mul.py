"""Fused SwiGLU activation: `silu(gate) * up` over a merged `[gate | up]` row in one pass.

Same rounding as the torch reference (`engine/layers/activation.py`): silu is computed in float32 and
rounded to the activation dtype (torch's silu on bf16/fp16), then the product is rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [T, 2 * I], row stride stride_x: gate in [0, I), up in [I, 2I)
    out_ptr,  # [T, I] contiguous
    stride_x,
    width,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[T, 2I] -> [T, I]`: `silu(x[:, :I]) * x[:, I:]`."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, 2 * I] with unit column stride, got {tuple(x.shape)} strides {x.stride()}")
    check_launch_device(_silu_mul_kernel, x=x)
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows and width:
        _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK))](x, out, x.stride(0), width, BLOCK=BLOCK, num_warps=4)
    return out
