"""The one-launch activation quantization (engine/kernels/fp8_quant.py) under triton's CPU interpreter: the
same e4m3 bytes and scales as the torch reference (engine/quant/fp8.py quantize_rows / quantize_row_groups),
per row and per 128-column group, with rows padded to a larger count and scales written with the rows
contiguous; equal bytes but for the interpreter's own e4m3 rounding slips (tests/support/e4m3_bytes.py).
The compiled kernel is checked on the GPU in tests/gpu/test_fp8_kernels.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.e4m3_bytes import same_bytes_but_for_interpreter_rounding
from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(quant,) = import_interpreted("engine.kernels.fp8_quant")

from engine.quant.fp8 import quantize_row_groups, quantize_rows  # noqa: E402

# bf16 activations divided by a scale from their own bf16 absmax hit exact e4m3 ties often (~2.7% of the values
# of these tests), each of which the interpreter may round the other way.
TIE_SHARE = 0.05


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, rows)[:, None]  # rows of far apart scale
    x[0, : cols // 2] = 0.0  # a half-zero row; a zero group where cols >= 256
    return x.to(torch.bfloat16)


@pytest.mark.parametrize(("rows", "cols"), [(1, 256), (5, 300), (16, 1000)])
def test_per_row_matches_the_reference_bytes(rows: int, cols: int) -> None:
    x = _activations(rows, cols, seed=rows + cols)
    q, scale = quant.quantize_activations(x)
    ref_q, ref_scale = quantize_rows(x)
    assert scale.shape == (rows,) and torch.equal(scale, ref_scale)
    assert q.dtype == torch.float8_e4m3fn and same_bytes_but_for_interpreter_rounding(q, ref_q, TIE_SHARE)


@pytest.mark.parametrize(("rows", "cols", "rows_out"), [(3, 256, 16), (17, 300, 32)])
def test_groups_padded_and_outer_major_match_the_reference(rows: int, cols: int, rows_out: int) -> None:
    x = _activations(rows, cols, seed=cols)
    q, scale = quant.quantize_activations(x, 128, rows_out, scales_row_major=False)
    padded = torch.cat([x, torch.zeros(rows_out - rows, cols, dtype=x.dtype)])
    ref_q, ref_scale = quantize_row_groups(padded)
    assert scale.shape == (rows_out, 2 if cols <= 256 else 3) and scale.stride() == (1, rows_out)
    assert torch.equal(scale, ref_scale)
    assert same_bytes_but_for_interpreter_rounding(q, ref_q, TIE_SHARE)


def test_a_large_value_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[1e30, 1.0, -1e30, 0.0]], dtype=torch.float32)
    q, scale = quant.quantize_activations(x)
    assert torch.isfinite(q.float()).all() and q.float().abs().max().item() == 448.0


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="rows_out"):
        quant.quantize_activations(torch.zeros(4, 8), rows_out=2)
    with pytest.raises(ValueError, match="unit column stride"):
        quant.quantize_activations(torch.zeros(8, 4).t())
