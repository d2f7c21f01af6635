"""FP8 (e4m3) quantization arithmetic and the FP8 GEMMs on CUDA (a Triton kernel for decode sizes,
`torch._scaled_mm` for prefill), with a reference of the same rounding elsewhere.

Scales are *dequantization* scales everywhere (`real = fp8 * scale`), the convention of compressed-tensors
checkpoints and of DeepSeek's `weight_scale_inv` alike. Two weight layouts:
- per output row: `scale[N]` float32. Per-tensor checkpoints are stored this way too (the scalar repeated
  over the rows of its projection), which is exact and lets merged q/k/v or gate/up projections that each
  had their own tensor scale share one matmul;
- 128 x 128 blocks: `scale[ceil(N/128), ceil(K/128)]` float32 (DeepSeek-V3, Qwen3-FP8).

Three GEMMs, chosen by the number of activation rows M (tokens in the step):
- M <= WEIGHT_ONLY_MAX_ROWS (decode): weight-only. The activations stay in their dtype and the e4m3 weight
  is widened to it in registers (`engine/kernels/fp8_weight_gemm.py` on CUDA). Such a GEMM is bound by
  reading W, so this is where FP8's halved bytes pay, and it launches no activation quantization; the
  design of TensorRT-LLM's small-batch FP8 GEMM and of vLLM's FP8 Marlin;
- M <= FP8_DOT_MAX_ROWS, row-scaled weights (large decode batches): activations quantized per token in one
  Triton launch, then the same Triton kernel with both operands in e4m3 (faster than cuBLASLt's FP8 GEMM there);
- larger M (prefill): activations quantized dynamically, one scale per token (per-row weights) or per
  token and per 128-column group (block weights), and `torch._scaled_mm` on the FP8 tensor cores, the
  pairing it supports on Hopper.

The reference (CPU, and CUDA before SM89) multiplies the *dequantized fp8 values* in float32 (with the
activations rounded as the large-M path rounds them, and unrounded for small M), so it carries exactly
the rounding of the FP8 path: accuracy measured on CPU is the accuracy the GPU path serves, up to
accumulation order.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_fused_kernels
from engine.quant.config import BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# A row of zeros still needs a finite scale; any tiny positive value gives zeros back.
MIN_SCALE = 1e-12
# Up to this many tokens a projection runs weight-only (see the module docstring): memory-bound there. On an
# H200 (2026-12-02, graph-timed) widening the weight lost from 32 rows on; at 16 rows the e4m3-activation
# variant below was already ahead on three of four 8B projections, so 2-15 rows are the next to measure.
WEIGHT_ONLY_MAX_ROWS = 16
# Past it and up to here (row-scaled weights), the activations are quantized in one launch and the same Triton
# kernel multiplies both in e4m3 (no widening in registers); beyond, `_scaled_mm`. At 64 rows on an H200
# (2026-12-02, graph-timed `bench_fp8_gemm --rows 16 64`) it took 14.7 / 12.7 / 45.4 / 33.1 us for the 8B
# qkv / o / gate_up / down against `_scaled_mm`'s 16.2 / 15.7 / 45.5 / 40.9 (with its quantization), and the
# batch-64 decode step 7.83 ms against 8.61 (bf16 7.93). Block-scaled weights keep `_scaled_mm` (unmeasured).
FP8_DOT_MAX_ROWS = 64


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` saturated to +-448 and rounded to e4m3 (a plain cast turns overflow into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, C]` -> (fp8 `[R, C]`, scale `[R]` float32): one scale per row (weights per output channel,
    activations per token)."""
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(x, scale.unsqueeze(-1)), scale


def quantize_row_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`[R, C]` -> (fp8 `[R, C]`, scale `[R, ceil(C/group)]`): one scale per row and column group."""
    rows, cols = x.shape
    padded = _pad_to(x, rows, group * _cdiv(cols, group)).view(rows, -1, group)
    scale = (padded.abs().amax(dim=-1).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    q = to_fp8(padded, scale.unsqueeze(-1)).view(rows, -1)[:, :cols]
    return q.contiguous(), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (fp8 `[N, K]`, scale `[ceil(N/block), ceil(K/block)]`): one scale per block x block tile."""
    n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    tiles = _pad_to(w, nb * block, kb * block).view(nb, block, kb, block)
    scale = (tiles.abs().amax(dim=(1, 3)).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    q = to_fp8(tiles, scale[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of a per-row quantized `[R, C]` tensor."""
    return q.float() * scale.unsqueeze(-1)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 values of a block-quantized `[N, K]` tensor (`scale[ceil(N/block), >= ceil(K/block)]`)."""
    n, k = q.shape
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * full


def fp8_linear(
    x: torch.Tensor,  # [T, K] activations (bf16/fp16/fp32)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] (per row) or [ceil(N/128), ceil(K/128)] (blocks), float32
    bias: torch.Tensor | None,
    dequantized: torch.Tensor | None = None,  # [N, K] float32 `dequantize_weight` of W, reused (reference only)
) -> torch.Tensor:  # [T, N] in x's dtype
    """`x W^T + b` with W in FP8: weight-only for up to WEIGHT_ONLY_MAX_ROWS tokens, else x quantized on
    the fly (per token, or per token and 128-group) and multiplied in FP8.

    The reference path may be handed W already dequantized: converting e4m3 to float32 costs ~30 ns per
    value on CPU, which would otherwise dominate every step."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    blocked = weight_scale.dim() == 2
    weight_only = x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS
    triton_gemm = _has_fp8_tensor_cores(x2) and use_fused_kernels(x2)
    if weight_only and triton_gemm:
        from engine.kernels.fp8_weight_gemm import fp8_weight_gemm  # imports triton: CUDA only

        out = fp8_weight_gemm(x2.contiguous(), weight, weight_scale)
    elif x2.shape[0] <= FP8_DOT_MAX_ROWS and triton_gemm and not blocked:
        from engine.kernels.fp8_weight_gemm import fp8_weight_gemm

        xq, xs = _quantize_activation_rows(x2)
        out = fp8_weight_gemm(xq, weight, weight_scale, x_scale=xs, out_dtype=x.dtype)
    elif _has_fp8_tensor_cores(x2):
        out = _scaled_mm_blocks(x2, weight, weight_scale) if blocked else _scaled_mm_rows(x2, weight, weight_scale)
        out = out.to(x.dtype)
    else:
        w_real = dequantize_weight(weight, weight_scale) if dequantized is None else dequantized
        out = (x2.float() @ w_real.t() if weight_only else reference_linear(x2, w_real, blocked)).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, weight.shape[0])


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float32 `[N, K]` values of an FP8 weight, per-row (`scale[N]`) or block (`scale` 2-D) scaled."""
    if weight_scale.dim() == 2:
        return dequantize_blocks(weight, weight_scale)
    return dequantize_rows(weight, weight_scale)


def reference_linear(x: torch.Tensor, w_real: torch.Tensor, blocked: bool) -> torch.Tensor:
    """float32 matmul of the dequantized weight and x rounded as the FP8 path rounds it."""
    if blocked:
        xq, xs = quantize_row_groups(x)
        x_real = dequantize_blocks_rows(xq, xs)
    else:
        xq, xs = quantize_rows(x)
        x_real = dequantize_rows(xq, xs)
    return x_real @ w_real.t()


def dequantize_blocks_rows(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """float32 values of a `[R, C]` tensor quantized per row and column group (`quantize_row_groups`)."""
    return q.float() * scale.repeat_interleave(group, 1)[:, : q.shape[1]]


def _scaled_mm_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Row-wise scaled FP8 GEMM (SM89+): scale_a `[T, 1]`, scale_b `[1, N]`; W^T is column-major as needed."""
    xq, xs = _quantize_activation_rows(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                            out_dtype=torch.bfloat16)


# cuBLASLt refuses block-scaled GEMMs whose row count leaves the activation scales' column stride
# unaligned (CUBLAS_STATUS_NOT_SUPPORTED at 17 rows on an H200, 2026-12-02; 16, 64 and 4096 ran): the
# rows are padded with zeros (scale MIN_SCALE, products 0) and the extra output rows dropped.
_BLOCK_GEMM_ROW_ALIGN = 16


def _scaled_mm_blocks(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """(1 x 128 activations) x (128 x 128 weights) scaled GEMM (SM90, cuBLAS >= 12.9). Both scale tensors
    must be outer-dimension-major: activation scales `[T, K/128]` with T contiguous, weight scales
    `[K/128 padded to 4, N/128]` transposed from `[N/128, K/128 padded]` (PyTorch's own test recipe)."""
    import torch.nn.functional as F

    rows = x.shape[0]
    aligned = _BLOCK_GEMM_ROW_ALIGN * _cdiv(rows, _BLOCK_GEMM_ROW_ALIGN)
    xq, xs_major = _quantize_activation_groups(x, aligned)
    kb = weight_scale.shape[1]
    padded_kb = 4 * _cdiv(kb, 4)
    ws = weight_scale if padded_kb == kb else torch.nn.functional.pad(weight_scale, (0, padded_kb - kb), value=1.0)
    out = F.scaled_mm(
        xq, weight.t(),
        [xs_major], [F.ScalingType.BlockWise1x128], [ws.contiguous().t()],
        [F.ScalingType.BlockWise128x128], output_dtype=torch.bfloat16,
    )
    return out[:rows]


def _quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization before `_scaled_mm`: one Triton launch on CUDA (engine/kernels/fp8_quant.py),
    the same rounding as `quantize_rows`."""
    if use_fused_kernels(x):
        from engine.kernels.fp8_quant import quantize_activations  # imports triton: CUDA only

        return quantize_activations(x.contiguous())
    return quantize_rows(x)


def _quantize_activation_groups(x: torch.Tensor, rows_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column quantization padded with zero rows to `rows_out`, its scales
    outer-dimension-major (`[rows_out, K/128]` with the rows contiguous), as block-scaled `scaled_mm` wants."""
    if use_fused_kernels(x):
        from engine.kernels.fp8_quant import quantize_activations

        return quantize_activations(x.contiguous(), BLOCK, rows_out, scales_row_major=False)
    xq, xs = quantize_row_groups(_pad_to(x, rows_out, x.shape[1]))
    # Outer-dimension-major by explicit strides: `.t().contiguous().t()` keeps a single-row [1, K/128] as it is
    # (a size-1 dimension makes it count as contiguous), which cuBLAS then refuses.
    xs_major = torch.empty_strided(xs.shape, (1, max(xs.shape[0], 1)), dtype=xs.dtype, device=xs.device)
    xs_major.copy_(xs)
    return xq, xs_major


def _has_fp8_tensor_cores(x: torch.Tensor) -> bool:
    """`_scaled_mm` needs SM89+ (Ada/Hopper); elsewhere the reference runs."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    if (r, c) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
