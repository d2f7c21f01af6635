"""CI smoke of the FP8 accuracy lab scripts: lab/micro/fp8_accuracy.py (4 prompts x 16 tokens and 4
perplexity segments of the default model, FP8 weights + FP8 KV against bf16; loose bounds, 64
positions; the full run's figures are in docs/benchmarks.md) and fp8_error_breakdown.py (32
tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.quant import fp8
from lab.micro.fp8_accuracy import main, weight_only_rows
from lab.micro.fp8_error_breakdown import main as breakdown_main


def test_fp8_accuracy_smoke_reports_agreement_and_perplexity(default_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    assert main(["--smoke", "--variants", "fp8_weights_fp8_kv", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    fp8 = report["fp8_weights_fp8_kv"]
    assert fp8["positions"] == 4 * 16 and report["ppl_segments"] == 4
    assert fp8["top1_agreement"] >= 0.75 and fp8["top1_agreement_generated"] >= 0.75
    assert report["dtype"] == "bfloat16" and report["baseline"]["top1_agreement_generated"] >= 0.9
    assert abs(fp8["perplexity_vs_baseline"]) < 0.10
    assert 0 < report["kv_absmax"]["k"] < 448 and 0 < report["kv_absmax"]["v"] < 448  # why KV scale 1.0 is safe


def test_decode_arithmetic_switch_makes_every_projection_weight_only_and_restores_the_threshold() -> None:
    """The `_decode` variant's switch: a prefill-sized matmul computes x times the dequantized weight
    (activations unrounded, as a decode step does), and the engine's threshold is back afterwards."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 128, generator=gen), torch.randn(32, 128, generator=gen)
    wq, ws = fp8.quantize_rows(w)
    weight_only = x @ fp8.dequantize_rows(wq, ws).t()
    assert not torch.allclose(fp8.fp8_linear(x, wq, ws, None), weight_only, rtol=1e-5, atol=1e-4)
    with weight_only_rows(1 << 30):
        assert torch.allclose(fp8.fp8_linear(x, wq, ws, None), weight_only, rtol=1e-5, atol=1e-4)
    assert fp8.WEIGHT_ONLY_MAX_ROWS == 16


def test_error_breakdown_reports_every_projection_and_layer(default_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "err.json"
    assert breakdown_main(["--tokens", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["projections"]) == 4 * 30 and len(report["kv"]) == 2 * 30  # SmolLM2-135M: 30 layers
    summary = report["summary"]
    # e4m3 keeps 3 mantissa bits: one rounding costs a few percent, two (a prefill's) more than one
    assert 0.005 < summary["weight_per_channel"] < 0.06 and summary["prefill"] > summary["weight_per_channel"]
    assert 0.01 < summary["kv_scale_1"] < 0.05
