"""Dynamic FP8 quantization of activations in one launch: one scale per token (per-row weights) or per token and
128-column group (block-scaled weights), the rounding of `engine/quant/fp8.py`'s torch reference.

Before an FP8 GEMM the activations must be e4m3 too. In torch that is an absmax, a divide, a clamp and a cast,
6-8 kernels per projection: on an H200 (2026-12-02, `lab/micro/bench_fp8_gemm.py`, graph-replayed) 19-30 us per
8B projection at 1-64 rows, against this kernel's 10-19 us (both timed as a one-call graph, its launch
included) and 1-3 us added to a GEMM inside a longer graph, as the decode step runs it. Here one program reads
one group of one row, takes its absmax, and writes the e4m3 values and the group's dequantization scale.

The scale may be written with any strides: block-scaled `_scaled_mm` wants the scales outer-dimension-major
(`[rows, groups]` with the rows contiguous), so they are written that way directly. Rows past the input's are
written as zeros (scale `MIN_SCALE`): the block-scaled GEMM needs its row count padded to 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device, fp8_saturate
from engine.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [R, C] bf16/fp16/fp32, unit column stride
    q_ptr,  # [R_out >= R, C] float8_e4m3fn, contiguous
    s_ptr,  # [R_out, G] float32, any strides
    R, C,
    stride_xr, stride_sr, stride_sg,
    GROUP: tl.constexpr,  # columns per scale
    BLOCK: tl.constexpr,  # next power of two >= GROUP
    FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr,
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = group * GROUP + offs
    ok = (offs < GROUP) & (cols < C)
    real_row = (offs * 0 + row) < R  # padding rows read as zeros
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + cols, mask=ok & real_row, other=0.0)
    # abs and max are exact in x's dtype; the divide is float32, as the reference's `.float() / FP8_MAX`.
    amax = tl.max(tl.abs(x), axis=0).to(tl.float32)
    scale = tl.maximum(amax / FP8_MAX_C, MIN_SCALE_C)
    q = fp8_saturate(x, scale)
    tl.store(q_ptr + row.to(tl.int64) * C + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sr + group * stride_sg, scale)


def quantize_activations(x: torch.Tensor, group: int | None = None, rows_out: int | None = None,
                         scales_row_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, C]` -> (e4m3 `[rows_out, C]`, float32 scales `[rows_out]` for `group=None` (one per row), else
    `[rows_out, ceil(C/group)]`, row-major or with the rows contiguous). `rows_out >= R` pads with zero rows."""
    r, c = x.shape
    per_row = group is None
    rows_out = r if rows_out is None else rows_out
    if x.stride(-1) != 1 or rows_out < r:
        raise ValueError(f"x must have unit column stride and rows_out >= {r}, got {x.stride()} / {rows_out}")
    group = c if group is None else group
    groups = triton.cdiv(c, group)
    q = torch.empty((rows_out, c), dtype=FP8_DTYPE, device=x.device)
    if scales_row_major:
        scale = torch.empty((rows_out, groups), dtype=torch.float32, device=x.device)
    else:
        scale = torch.empty_strided((rows_out, groups), (1, max(rows_out, 1)), dtype=torch.float32, device=x.device)
    check_launch_device(_quantize_groups_kernel, x=x, q=q, scale=scale)
    if rows_out and c:
        _quantize_groups_kernel[(rows_out, groups)](
            x, q, scale, r, c, x.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, BLOCK=triton.next_power_of_2(group), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
            num_warps=8 if group >= 4096 else 4,
        )
    return q, (scale.view(rows_out) if per_row else scale)
