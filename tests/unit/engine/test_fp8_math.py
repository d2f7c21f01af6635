"""FP8 (e4m3) quantization arithmetic and the reference FP8 GEMM (engine/quant/fp8.py, config.py)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.quant.config import Fp8Config, IgnoreMatch, WeightScaling, checkpoint_fp8_config, resolve_fp8_config
from engine.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    WEIGHT_ONLY_MAX_ROWS,
    dequantize_blocks,
    dequantize_rows,
    fp8_linear,
    quantize_blocks,
    quantize_row_groups,
    quantize_rows,
)

E4M3_RELATIVE_STEP = 2.0**-3  # 3 mantissa bits: neighbouring normal values differ by at most 1/8


def test_per_row_quantization_keeps_every_value_within_half_an_e4m3_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (64,)
    back = dequantize_rows(q, scale)
    assert torch.allclose(back.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6)  # row max -> 448
    normal = w.abs() >= scale[:, None] * 2.0**-6  # below e4m3's smallest normal the step is absolute
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= E4M3_RELATIVE_STEP / 2 + 1e-6


def test_saturation_and_zero_rows_give_finite_values() -> None:
    w = torch.zeros(2, 8)
    w[1] = torch.tensor([1e30, -1e30, 1.0, 0, 0, 0, 0, 0])
    q, scale = quantize_rows(w)
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[0], torch.zeros(8))
    assert back[1, 0] == pytest.approx(1e30, rel=1e-6) and back[1, 1] == pytest.approx(-1e30, rel=1e-6)


def test_block_quantization_scales_each_128_tile_on_its_own() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    w[:128, :128] *= 1000.0  # one loud tile must not flatten its neighbours to zero
    q, scale = quantize_blocks(w)
    assert scale.shape == (2, 3)
    assert scale[0, 0] == pytest.approx(scale[0, 1].item() * 1000.0, rel=0.5)
    back = dequantize_blocks(q, scale)
    assert torch.allclose(back, w, rtol=E4M3_RELATIVE_STEP, atol=scale.max().item() * 2.0**-6)
    quiet = back[128:, 128:]
    assert (quiet != 0).float().mean() > 0.99


def test_row_group_quantization_scales_each_token_and_128_column_group() -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_row_groups(x)
    assert q.shape == (5, 300) and scale.shape == (5, 3)
    assert torch.allclose(scale[:, 2], x[:, 256:].abs().amax(dim=1) / FP8_MAX)


@pytest.mark.parametrize("scaling", ["rows", "blocks"])
def test_reference_fp8_linear_is_the_product_of_the_rounded_operands(scaling: str) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = WEIGHT_ONLY_MAX_ROWS + 3  # past decode size: activations are quantized per token
    x, w, bias = torch.randn(rows, 256, generator=gen), torch.randn(384, 256, generator=gen), torch.randn(384)
    if scaling == "rows":
        wq, ws = quantize_rows(w)
        xq, xs = quantize_rows(x)
        expected = dequantize_rows(xq, xs) @ dequantize_rows(wq, ws).t() + bias
    else:
        wq, ws = quantize_blocks(w)
        xq, xs = quantize_row_groups(x)
        x_real = xq.float() * xs.repeat_interleave(128, 1)
        expected = x_real @ dequantize_blocks(wq, ws).t() + bias
    out = fp8_linear(x, wq, ws, bias)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-4)
    exact = x @ w.t() + bias
    assert ((out - exact).norm() / exact.norm()).item() < 0.05  # two e4m3 roundings: a few percent at most


@pytest.mark.parametrize("scaling", ["rows", "blocks"])
def test_decode_size_fp8_linear_is_weight_only(scaling: str) -> None:
    """Up to WEIGHT_ONLY_MAX_ROWS tokens the activations are not rounded: the product is x times the
    dequantized weight, and closer to the exact product than the quantized-activation path."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(WEIGHT_ONLY_MAX_ROWS, 256, generator=gen), torch.randn(384, 256, generator=gen)
    wq, ws = quantize_rows(w) if scaling == "rows" else quantize_blocks(w)
    w_real = dequantize_rows(wq, ws) if scaling == "rows" else dequantize_blocks(wq, ws)
    out = fp8_linear(x, wq, ws, None)
    assert torch.allclose(out, x @ w_real.t(), rtol=1e-5, atol=1e-4)
    past = fp8_linear(torch.cat([x, x[:1]]), wq, ws, None)[:WEIGHT_ONLY_MAX_ROWS]  # one row more: W8A8
    exact = x @ w.t()
    assert (out - exact).norm() < (past - exact).norm()


def test_fp8_linear_keeps_the_activation_dtype_and_leading_dims() -> None:
    wq, ws = quantize_rows(torch.randn(32, 64))
    out = fp8_linear(torch.randn(2, 3, 64, dtype=torch.bfloat16), wq, ws, None)
    assert out.shape == (2, 3, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(("qc", "expected"), [
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     Fp8Config(WeightScaling.BLOCK_128, True, (), IgnoreMatch.SUBSTRING)),
    ({"quant_method": "fp8", "activation_scheme": "static", "modules_to_not_convert": ["lm_head"]},
     Fp8Config(WeightScaling.PER_ROW, True, ("lm_head",), IgnoreMatch.SUBSTRING)),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}},
     Fp8Config(WeightScaling.PER_ROW, from_checkpoint=True)),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}}, "ignore": ["lm_head"]},
     Fp8Config(WeightScaling.PER_ROW, True, ("lm_head",))),
])
def test_checkpoint_formats_are_recognised(qc: dict, expected: Fp8Config) -> None:
    assert checkpoint_fp8_config({"quantization_config": qc}) == expected


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, "8-bit float"),
])
def test_unsupported_quantization_is_refused_by_name(qc: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checkpoint_fp8_config({"quantization_config": qc})


def test_ignore_lists_match_as_their_formats_define() -> None:
    """compressed-tensors: a whole module name or `re:` + a regex matched from the start; Hugging Face's
    `modules_to_not_convert`: any part of the name."""
    names = Fp8Config(ignore=("lm_head", r"re:.*layers\.[01]\.mlp\.down_proj$"))
    assert names.ignores("lm_head") and names.ignores("model.layers.1.mlp.down_proj")
    assert not names.ignores("model.lm_head") and not names.ignores("model.layers.11.mlp.down_proj")
    substring = Fp8Config(ignore=("layers.1.mlp", "o_proj"), ignore_match=IgnoreMatch.SUBSTRING)
    assert substring.ignores("model.layers.1.mlp.up_proj") and substring.ignores("model.layers.7.self_attn.o_proj")
    assert not substring.ignores("model.layers.11.mlp.up_proj")
    assert not substring.ignores("model.layers.1.self_attn.q_proj")
    gate_up = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert substring.ignores_merged(gate_up) and not names.ignores_merged(gate_up)
    with pytest.raises(ConfigError, match="must share a precision"):
        Fp8Config(ignore=("model.layers.1.mlp.up_proj",)).ignores_merged(gate_up)


def test_online_fp8_is_per_row_and_a_quantized_checkpoint_wins() -> None:
    assert checkpoint_fp8_config({}) is None
    assert resolve_fp8_config(None, None) is None
    assert resolve_fp8_config("fp8", None) == Fp8Config(WeightScaling.PER_ROW, from_checkpoint=False)
    stored = Fp8Config(WeightScaling.BLOCK_128, from_checkpoint=True)
    assert resolve_fp8_config(None, stored) == stored and resolve_fp8_config("fp8", stored) == stored
    with pytest.raises(ConfigError, match="valid: none, fp8"):
        resolve_fp8_config("int8", None)
