"""The decode-size FP8 GEMM (engine/kernels/fp8_weight_gemm.py) under triton's CPU interpreter, against the
torch reference: activations times the dequantized e4m3 weight, per-row and 128 x 128 block scales, ragged
N and K, 1 to 64 rows (row tiles of 16, 32 and 64). The compiled kernel is checked on the GPU in
tests/gpu/test_fp8_kernels.py.

Tolerance: the kernel accumulates in float32 and rounds its output to x's dtype once, so against the
float32 reference of the same operands the error is the output rounding: half a bf16 step compiled, one
whole step here (triton 3.9's interpreter truncates float32 -> bf16 instead of rounding to nearest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(gemm,) = import_interpreted("engine.kernels.fp8_weight_gemm")

from engine.quant.fp8 import dequantize_weight, quantize_blocks, quantize_rows  # noqa: E402

BF16_STEP = 2.0**-7  # relative: 7 stored mantissa bits


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _operands(m: int, n: int, k: int, blocked: bool, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]  # rows of very different scale
    wq, ws = quantize_blocks(w) if blocked else quantize_rows(w)
    return x, wq, ws


@pytest.mark.parametrize(("m", "n", "k", "blocked"), [
    (1, 48, 256, False),
    (3, 40, 300, False),  # N and K not multiples of the tile
    (16, 130, 384, True),  # N straddles two scale blocks
    (5, 200, 260, True),  # K ends in a partial scale block
    (29, 40, 256, False),  # a 32-row tile
    (64, 33, 256, True),  # a full 64-row tile
])
def test_matches_activations_times_the_dequantized_weight(m: int, n: int, k: int, blocked: bool) -> None:
    x, wq, ws = _operands(m, n, k, blocked, seed=m * n)
    out = gemm.fp8_weight_gemm(x, wq, ws)
    ref = x.float() @ dequantize_weight(wq, ws).t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=BF16_STEP, atol=ref.abs().max().item() * 1e-3)


@pytest.mark.parametrize(("m", "n", "k", "blocked", "split_k"), [
    (1, 40, 1024, False, 3),  # K tiles 4 over 3 splits: the last split shorter, none empty
    (5, 130, 640, True, 4),  # block scales inside each split's K range
    (2, 16, 300, False, 8),  # more splits asked than K tiles: capped
])
def test_split_k_sums_the_same_product(m: int, n: int, k: int, blocked: bool, split_k: int) -> None:
    x, wq, ws = _operands(m, n, k, blocked, seed=k + split_k)
    config = gemm.TileConfig(block_n=32, block_k=128 if blocked else 256, num_warps=4, num_stages=2, split_k=split_k)
    out = gemm.fp8_weight_gemm(x, wq, ws, config)
    ref = x.float() @ dequantize_weight(wq, ws).t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=BF16_STEP, atol=ref.abs().max().item() * 1e-3)


@pytest.mark.parametrize(("m", "n", "k", "blocked"), [(16, 40, 512, False), (33, 130, 384, True)])
def test_fp8_activations_with_their_scales(m: int, n: int, k: int, blocked: bool) -> None:
    """x quantized per token (and per 128-group for block weights), both operands e4m3 in the dot: against the
    float32 product of the two dequantized operands."""
    from engine.quant.fp8 import dequantize_blocks_rows, quantize_row_groups

    x, wq, ws = _operands(m, n, k, blocked, seed=m + k)
    xq, xs = quantize_row_groups(x) if blocked else quantize_rows(x)
    x_real = dequantize_blocks_rows(xq, xs) if blocked else xq.float() * xs[:, None]
    config = gemm.TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=2, split_k=2)
    out = gemm.fp8_weight_gemm(xq, wq, ws, config, x_scale=xs, out_dtype=torch.bfloat16)
    ref = x_real @ dequantize_weight(wq, ws).t()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=BF16_STEP, atol=ref.abs().max().item() * 1e-3)


def test_fp8_activations_need_matching_scales() -> None:
    xq = torch.zeros(4, 256).to(torch.float8_e4m3fn)
    wq, ws = torch.zeros(8, 256).to(torch.float8_e4m3fn), torch.ones(8)
    with pytest.raises(ValueError, match="x_scale float32"):
        gemm.fp8_weight_gemm(xq, wq, ws, x_scale=torch.ones(4, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn with x_scale"):
        gemm.fp8_weight_gemm(xq, wq, ws)


def test_split_k_is_one_off_cuda_and_grows_with_few_programs() -> None:
    assert gemm.auto_split_k(programs=8, k_tiles=64, device=torch.device("cpu")) == 1


def test_each_block_scale_reaches_only_its_own_tile() -> None:
    x = torch.ones(2, 256, dtype=torch.bfloat16)
    wq = torch.ones(256, 256).to(torch.float8_e4m3fn)
    ws = torch.tensor([[1.0, 2.0], [4.0, 8.0]])  # [N/128, K/128]
    wide = gemm.TileConfig(block_n=128, block_k=128, num_warps=4, num_stages=2)  # 2 programs: the interpreter is slow
    out = gemm.fp8_weight_gemm(x, wq, ws, wide).float()
    assert torch.equal(out[:, :128], torch.full((2, 128), 128 * 1.0 + 128 * 2.0))
    assert torch.equal(out[:, 128:], torch.full((2, 128), 128 * 4.0 + 128 * 8.0))


def test_fp16_and_fp32_activations_keep_their_dtype() -> None:
    x, wq, ws = _operands(4, 32, 128, False, seed=7)
    ref = x.float() @ dequantize_weight(wq, ws).t()
    for dtype in (torch.float16, torch.float32):
        out = gemm.fp8_weight_gemm(x.to(dtype), wq, ws)
        assert out.dtype == dtype and torch.allclose(out.float(), ref, rtol=2.0**-10, atol=1e-2)


@pytest.mark.parametrize(("x", "w", "s", "message"), [
    (torch.zeros(65, 64, dtype=torch.bfloat16), torch.zeros(8, 64), torch.ones(8), "M <= 64"),
    (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 32), torch.ones(8), "weight must be"),
    (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64), torch.ones(4), "weight_scale must be"),
    (torch.zeros(1, 64, dtype=torch.int32), torch.zeros(8, 64), torch.ones(8), "bf16, fp16 or fp32"),
])
def test_bad_operands_are_refused(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gemm.fp8_weight_gemm(x, w.to(torch.float8_e4m3fn), s)


def test_a_block_k_straddling_scale_blocks_is_refused() -> None:
    x, wq, ws = _operands(1, 128, 256, True, seed=3)
    with pytest.raises(ValueError, match="must divide 128"):
        gemm.fp8_weight_gemm(x, wq, ws, gemm.TileConfig(block_n=16, block_k=256, num_warps=4, num_stages=2))
