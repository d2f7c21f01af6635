"""Decode-size FP8 GEMM: `out = x W^T` with W in e4m3, x either left in bf16/fp16 (weight-only) or in e4m3
with its own per-token scales.

At decode a projection's matmul is a few rows of activations against the whole weight: it is bound by
reading W, and the FP8 win is reading one byte per weight instead of two. Weight-only, this kernel reads the
e4m3 weight tile, widens it to the activations' dtype in registers (exact: every e4m3 value is a bf16/fp16
value), multiplies on the tensor cores with float32 accumulation and applies the dequantization scales to the
float32 sums: no activation quantization at all (the design of vLLM's FP8 Marlin and TensorRT-LLM's
small-batch FP8 GEMV). With more rows the widening costs more than a one-launch activation quantization
(engine/kernels/fp8_quant.py), and both operands go to the FP8 tensor cores as they are. Where K is long and
the output tiles few, K is split over programs (float32 partials, summed after). `engine/quant/fp8.py`
chooses the variant by M; past MAX_ROWS, `_scaled_mm`.

Scales (dequantization, `real = fp8 * scale`): per output row `[N]`, or per 128 x 128 block
`[ceil(N/128), >= ceil(K/128)]`; a block-scaled weight is walked in K tiles of at most 128 that never
straddle a scale block, each tile's partial sum scaled by its block's scale (and by the activations' scale
of that 128-column group when they are e4m3).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device, is_interpreted
from engine.kernels.paged_decode import dot_dtype_for

SCALE_BLOCK = 128  # the block edge of block-scaled FP8 weights (engine/quant/config.py BLOCK)
MAX_ROWS = 64  # the kernel holds every activation row in one tile: 16 (tl.dot's smallest M), 32 or 64 rows
# Up to 64 rows a decode projection is still bound by reading W (64 rows x 2 FLOP per weight byte is far below
# Hopper's ~200 FLOP/B). Graph-timed on an H200 (2026-12-02), widening the weight in registers lost from 32
# rows on (qkv at 64 rows: 39 us weight-only, 14.7 us with e4m3 activations); engine/quant/fp8.py's
# WEIGHT_ONLY_MAX_ROWS and FP8_DOT_MAX_ROWS pick the variant.


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # output features per program: small, so that even N = 4096 gives ~256 programs
    block_k: int  # K per iteration; <= 128 and dividing it for block-scaled weights
    num_warps: int
    num_stages: int  # loads in flight per program: what hides HBM latency in a memory-bound loop
    split_k: int = 0  # programs along K, each summing its K range into a float32 partial; 0 = by grid size


# Every program re-reads the activation rows (from L2) for its own BLOCK_N weight rows: x's traffic is
# M * 2 bytes per K against BLOCK_N bytes of weight, so more rows want wider programs; fewer rows want
# narrow ones, for enough programs to keep every SM reading (N = 4096 / 16 = 256 programs on 132 SMs).
# Row-scaled: `python -m lab.micro.bench_fp8_gemm --sweep --rows 1 16 --scalings rows` on an H200
# (2026-12-02) put 32 output rows per program first at 1 and 16 rows for every 8B projection but o
# (qkv 23 -> 31% of copy bandwidth at 1 row, gate_up 33 -> 57%, down 22 -> 34%); K per iteration and
# stages varied by shape, 256 / 3 is the best at qkv and within a few % elsewhere. Block-scaled: not
# swept yet (starting point).
ROW_SCALED = TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=3)
BLOCK_SCALED = TileConfig(block_n=16, block_k=128, num_warps=4, num_stages=5)
FEW_ROWS = 4  # block-scaled: up to here the narrow tiles above; past it twice as wide


@triton.jit
def _fp8_weight_gemm_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, or float8_e4m3fn with X_SCALED; unit column stride
    w_ptr,  # [N, K] float8_e4m3fn, unit column stride
    s_ptr,  # [N] (per row) or [ceil(N/128), >= ceil(K/128)] (blocks) float32
    xs_ptr,  # X_SCALED: x's scales, [M] (per row) or [M, ceil(K/128)] (blocks), float32
    out_ptr,  # [M, N] in the output dtype, or [SPLIT_K, M, N] float32 partials; contiguous
    M, N, K,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    stride_xm, stride_wn, stride_sn, stride_xsm, stride_xsg,
    BLOCKED: tl.constexpr,  # s holds 128 x 128 block scales
    X_SCALED: tl.constexpr,  # x is e4m3 with its own dequantization scales: both operands FP8 in the dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # x's dtype on the GPU; fp32 for fp32 x, and for bf16 under the interpreter
    DOT_PRECISION: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    rn_safe = tl.where(n_ok, rn, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                    other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptr + rn_safe[:, None] * stride_wn + rk[None, :], mask=k_ok[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w.to(DOT_DTYPE)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if BLOCKED:
            scale = tl.load(s_ptr + (rn_safe // 128) * stride_sn + k0 // 128)
            if X_SCALED:
                x_scale = tl.load(xs_ptr + rm * stride_xsm + (k0 // 128) * stride_xsg, mask=rm < M, other=0.0)
                acc += part * x_scale[:, None] * scale[None, :]
            else:
                acc += part * scale[None, :]
        else:
            acc += part
    if not BLOCKED:
        acc = acc * tl.load(s_ptr + rn_safe)[None, :]
        if X_SCALED:
            acc = acc * tl.load(xs_ptr + rm * stride_xsm, mask=rm < M, other=0.0)[:, None]
    out = out_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & n_ok[None, :])


def fp8_weight_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    config: TileConfig | None = None, x_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`[M, K] x [N, K]^T -> [M, N]` for M <= MAX_ROWS; `weight_scale` `[N]` or block `[Nb, Kb]`.

    Weight-only (x bf16/fp16/fp32, output in x's dtype), or with x in e4m3 and `x_scale` its per-row `[M]`
    (row-scaled weights) or per-row and 128-group `[M, Kb]` (block-scaled) scales, output in `out_dtype`:
    then both operands go to the FP8 tensor cores and nothing is widened in registers."""
    m, k = x.shape
    n = weight.shape[0]
    _check(x, weight, weight_scale, x_scale)
    blocked = weight_scale.dim() == 2
    cfg = config or default_config(m, blocked)
    if blocked and SCALE_BLOCK % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide {SCALE_BLOCK} for block-scaled weights")
    dtype = x.dtype if x_scale is None else out_dtype
    check_launch_device(_fp8_weight_gemm_kernel, x=x, weight=weight, weight_scale=weight_scale)
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=dtype, device=x.device)
    programs = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    splits = min(cfg.split_k or auto_split_k(programs, k_tiles, x.device), k_tiles)
    k_per_split = triton.cdiv(k_tiles, splits) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty split
    # Several splits each write a float32 partial, summed after: no atomics, so the result is deterministic.
    out = torch.empty((splits, m, n) if splits > 1 else (m, n),
                      dtype=torch.float32 if splits > 1 else dtype, device=x.device)
    dot_dtype, precision = _dot_operands(x, x_scale is not None)
    xs = weight_scale if x_scale is None else x_scale  # any float32 pointer when unused
    _fp8_weight_gemm_kernel[(programs, splits)](
        x, weight, weight_scale, xs, out, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), weight_scale.stride(0) if blocked else 1,
        xs.stride(0), xs.stride(1) if xs.dim() == 2 else 0,
        BLOCKED=blocked, X_SCALED=x_scale is not None, BLOCK_M=row_tile(m), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        num_warps=cfg.num_warps,
    )
    return out.sum(0).to(dtype) if splits > 1 else out


def _dot_operands(x: torch.Tensor, fp8_activations: bool) -> tuple[tl.dtype, str | None]:
    """The dot's operand dtype: e4m3 both (FP8 tensor cores) for e4m3 activations, else the activations'
    dtype; float32 under the interpreter, which has no e4m3 or correct bf16 arithmetic."""
    if not fp8_activations:
        return dot_dtype_for(x.dtype, _fp8_weight_gemm_kernel)
    if is_interpreted(_fp8_weight_gemm_kernel):
        return tl.float32, "ieee"
    return tl.float8e4nv, None


# Split K until the launch has about this many programs per SM: a program keeps num_stages tiles in flight,
# and one program per SM does not keep enough bytes moving to read HBM at full rate (o and down at 1 row:
# 128 programs on 132 SMs, 15-32% of copy bandwidth on an H200, 2026-12-02).
PROGRAMS_PER_SM = 4
# A split needs this many K tiles: at K = 4096 (16 tiles of 256) every split lost 1-3 points of copy bandwidth
# on an H200 (qkv 37 -> 34-36%, o 32 -> 29-30%), at K = 14336 (56 tiles) 5 splits gained 12 (down 40 -> 52%);
# graph-replayed, 2026-12-02.
MIN_TILES_PER_SPLIT = 10


def auto_split_k(programs: int, k_tiles: int, device: torch.device) -> int:
    """Programs along K for a launch of `programs` output tiles (1 off CUDA: the interpreter is slow)."""
    if device.type != "cuda":
        return 1
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device.index or 0), programs)
    return max(1, min(wanted, k_tiles // MIN_TILES_PER_SPLIT))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def row_tile(m: int) -> int:
    """The rows one tile holds for `m` activation rows: 16, 32 or 64 (16 for every decode-size step, as swept)."""
    return max(16, triton.next_power_of_2(m))


def default_config(m: int, blocked: bool) -> TileConfig:
    """The tile config for `m` activation rows (see ROW_SCALED)."""
    if not blocked:
        return ROW_SCALED
    return BLOCK_SCALED if m <= FEW_ROWS else replace(BLOCK_SCALED, block_n=2 * BLOCK_SCALED.block_n)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, x_scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(-1) != 1:
        raise ValueError(f"x must be [M <= {MAX_ROWS}, K] with unit column stride, got {tuple(x.shape)}")
    if x_scale is not None:
        _check_fp8_activations(x, weight_scale, x_scale)
    elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32 (or float8_e4m3fn with x_scale), got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] != x.shape[1] \
            or weight.stride(-1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, {x.shape[1]}] with unit column stride, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    rows_ok = weight_scale.shape == (n,) and weight_scale.is_contiguous()
    blocks_ok = weight_scale.dim() == 2 and weight_scale.shape[0] == blocks[0] \
        and weight_scale.shape[1] >= blocks[1] and weight_scale.stride(1) == 1
    if weight_scale.dtype != torch.float32 or not (rows_ok or blocks_ok):
        raise ValueError(f"weight_scale must be float32 [{n}] or [{blocks[0]}, >= {blocks[1]}], "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")


def _check_fp8_activations(x: torch.Tensor, weight_scale: torch.Tensor, x_scale: torch.Tensor) -> None:
    m, k = x.shape
    want = (m,) if weight_scale.dim() == 1 else (m, -(-k // SCALE_BLOCK))
    if x.dtype != torch.float8_e4m3fn or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != want:
        raise ValueError(f"with x_scale, x must be float8_e4m3fn and x_scale float32 {list(want)}, got "
                         f"{x.dtype} and {x_scale.dtype} {list(x_scale.shape)}")
