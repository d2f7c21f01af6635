"""lab/micro/fp8_sensitivity.py measures what the engine serves: its `all` variant gives the logits of the
engine's own `--quantization fp8` bit for bit (prefill and weight-only arithmetic), its parts pick the
projections they name, and the bf16 GEMM emulation (fp8_passes) computes what PyTorch's bf16 GEMM does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from lab.micro.fp8_passes import emulated_bf16_gemm, make_engine, sequence_logits
from lab.micro.fp8_sensitivity import Variant, apply_variant, projections

LAYERS = 30  # SmolLM2-135M


@pytest.fixture(scope="module")
def bf16_engine(default_model_dir: Path) -> Iterator[LLMEngine]:
    with emulated_bf16_gemm():
        yield make_engine("bfloat16", None, "auto", 1)


def _runner(engine: LLMEngine) -> ModelRunner:
    assert isinstance(engine.runner, ModelRunner)
    return engine.runner


@pytest.mark.parametrize("tokens", [40, 10])  # a prefill (activations rounded per token), weight-only
def test_all_variant_is_the_engines_fp8_bit_for_bit(bf16_engine: LLMEngine, tokens: int) -> None:
    ids = list(range(2000, 2000 + tokens))
    with emulated_bf16_gemm():
        served = sequence_logits(make_engine("bfloat16", "fp8", "auto", 1), ids)
        assert apply_variant(_runner(bf16_engine), Variant.parse("all", LAYERS)) == 0.0
        assert torch.equal(sequence_logits(bf16_engine, ids), served)
        apply_variant(_runner(bf16_engine), Variant.parse("keep:layers0-29", LAYERS))  # back to bf16
        assert not torch.equal(sequence_logits(bf16_engine, ids), served)


def test_parts_choose_their_rows_and_report_the_bf16_share(bf16_engine: LLMEngine) -> None:
    runner = _runner(bf16_engine)
    # per layer: q/k/v 576x(576+192+192), o 576x576, gate/up 2x1536x576, down 576x1536
    assert apply_variant(runner, Variant.parse("keep:down", LAYERS)) == pytest.approx(884736 / 3538944)
    assert apply_variant(runner, Variant.parse("only:down", LAYERS)) == pytest.approx(1 - 884736 / 3538944)
    assert apply_variant(runner, Variant.parse("keep:layers0,layers29", LAYERS)) == pytest.approx(2 / 30)
    assert apply_variant(runner, Variant.parse("only:k+v@layers3-4", LAYERS)) == pytest.approx(
        1 - 2 * 2 * 576 * 192 / (30 * 3538944))
    patched = {(layer, kind) for layer, kind, linear, _ in projections(runner) if "matmul" in linear.__dict__}
    assert patched == {(layer, kind) for layer in (3, 4) for kind in ("q", "k", "v")}  # the merged qkv matmul
    with pytest.raises(ValueError, match="projection kinds are"):
        Variant.parse("only:gate_proj", LAYERS)
    with pytest.raises(ValueError, match="expected all, only"):
        Variant.parse("down", LAYERS)
    apply_variant(runner, Variant.parse("keep:layers0-29", LAYERS))


def test_emulated_bf16_gemm_matches_the_native_one_and_is_restored() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1536, generator=gen).bfloat16()
    w = torch.randn(576, 1536, generator=gen).bfloat16()
    native, linear = F.linear(x, w), F.linear
    with emulated_bf16_gemm():
        emulated = F.linear(x, w)
        assert F.linear(x.float(), w.float()).dtype == torch.float32  # other dtypes untouched
    assert F.linear is linear and emulated.dtype == torch.bfloat16
    # the same float32 products and accumulation, rounded once: at most a last-bit difference (summation order)
    ulp = native.float().abs() * 2.0**-7
    assert bool(((emulated.float() - native.float()).abs() <= ulp).all())
