"""The fused MoE kernel over FP8 experts (engine/kernels/fused_moe.py: e4m3 weights widened in registers,
per-row or 128 x 128 block dequantization scales) under triton's CPU interpreter, against the torch
reference that dequantizes each expert as it is used (engine/layers/moe_ops.py).

Shapes with the awkward cases: an expert intermediate size that is not a multiple of 128 (the gate's and
the up's scale blocks kept apart), a hidden size that ends in a partial scale block, K tiles of 256 that
the kernel must cut to 128 under block scales, one token and a skewed batch. Tolerance: both sides
accumulate in float32 from the same e4m3 values and scales and round after each GEMM to x's dtype, so
for float32 activations only summation order differs (1e-5); for bf16 the interpreter's truncating
float32 -> bf16 rounding applies (see test_moe_interpret.py). The compiled kernel is checked on the GPU
in tests/gpu/test_moe_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(fused_moe,) = import_interpreted("engine.kernels.fused_moe")

from engine.kernels.fused_moe_configs import GemmTile, MoeKernelConfig  # noqa: E402
from engine.layers import moe_ops  # noqa: E402
from engine.layers.moe_ops import expert_outputs_reference  # noqa: E402
from engine.quant.fp8 import FP8_DTYPE  # noqa: E402

EXPERTS = 4
FP8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, w13_scale, w2, w2_scale


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, blocked: bool) -> FP8:
    q = moe_ops.quantize_experts(w13, w2, blocked)
    return q.w13, q.w13_scale, q.w2, q.w2_scale


def _float_experts(hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-1.5, 0, 2 * inter)[None, :, None]  # rows of very different magnitude
    return (torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 0.2 * row_scale,
            torch.randn(EXPERTS, hidden, inter, generator=gen) * 0.2)


def _ids(tokens: int, top_k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])


WIDE_K = MoeKernelConfig(16, GemmTile(32, 256, 4, 2), GemmTile(32, 256, 4, 2))  # block_k cut to 128 when blocked


@pytest.mark.parametrize(("blocked", "hidden", "inter", "tokens", "config"), [
    (False, 40, 24, 9, None),
    (False, 40, 24, 1, None),
    (True, 200, 72, 9, None),  # I = 72: gate and up each one partial block; H ends in a partial block
    (True, 136, 136, 5, WIDE_K),  # I straddles two blocks; K tiles of 256 cut to 128
    (True, 136, 136, 1, None),
])
def test_fp8_experts_match_the_dequantizing_reference(blocked: bool, hidden: int, inter: int, tokens: int,
                                                      config: MoeKernelConfig | None) -> None:
    w13q, w13s, w2q, w2s = quantize_experts(*_float_experts(hidden, inter, seed=hidden + inter), blocked)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    ids = _ids(tokens, 2, seed=tokens)
    got = fused_moe.fused_expert_outputs(x, ids, w13q, w2q, config, w13_scale=w13s, w2_scale=w2s)
    expected = expert_outputs_reference(x, ids, w13q, w2q, w13s, w2s)
    assert got.shape == (tokens, 2, hidden) and not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_activations_over_fp8_experts_match_the_reference() -> None:
    w13q, w13s, w2q, w2s = quantize_experts(*_float_experts(136, 72, seed=5), blocked=True)
    x = torch.randn(7, 136, generator=torch.Generator().manual_seed(6)).bfloat16()
    ids = _ids(7, 2, seed=7)
    got = fused_moe.fused_expert_outputs(x, ids, w13q, w2q, w13_scale=w13s, w2_scale=w2s)
    expected = expert_outputs_reference(x, ids, w13q, w2q, w13s, w2s)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - expected.double()).norm() / expected.double().norm()).item() <= 2e-2


def test_each_block_scale_reaches_only_its_own_expert_and_tile() -> None:
    """All-ones e4m3 weights; each (expert, gate/up, K block) scale a different power of two, so a scale
    read from the wrong block or expert changes the exact result."""
    hidden, inter = 256, 128
    w13 = torch.ones(EXPERTS, 2 * inter, hidden).to(FP8_DTYPE)
    w2 = torch.ones(EXPERTS, hidden, inter).to(FP8_DTYPE)
    w13s = 2.0 ** -torch.arange(EXPERTS * 2 * 2, dtype=torch.float32).view(EXPERTS, 2, 2)  # [E, gate|up, K blocks]
    w2s = torch.full((EXPERTS, 2, 1), 1.0 / 64)
    x = torch.full((1, hidden), 1.0 / 128)
    ids = torch.tensor([[3, 1]])
    got = fused_moe.fused_expert_outputs(x, ids, w13, w2, w13_scale=w13s, w2_scale=w2s)
    for slot, expert in enumerate(ids[0].tolist()):
        gate, up = (float(w13s[expert, half].sum()) for half in (0, 1))  # 128 * (1/128) * scale per K block
        act = gate / (1.0 + torch.exp(torch.tensor(-gate)).item()) * up
        assert torch.allclose(got[0, slot], torch.full((hidden,), act * inter / 64), rtol=1e-6)


@pytest.mark.parametrize(("w13_scale", "message"), [
    (torch.ones(EXPERTS, 48, dtype=torch.float64), "float32 scales"),
    (torch.ones(EXPERTS, 47), "per row"),
    (torch.ones(EXPERTS, 1, 1), "128 x 128 blocks"),
])
def test_bad_scales_are_refused(w13_scale: torch.Tensor, message: str) -> None:
    w13q, _, w2q, w2s = quantize_experts(*_float_experts(40, 24, seed=1), blocked=False)
    with pytest.raises(ValueError, match=message):
        fused_moe.fused_expert_outputs(torch.zeros(2, 40), _ids(2, 2, 1), w13q, w2q, w13_scale=w13_scale,
                                       w2_scale=w2s)


def test_fp8_weights_without_scales_are_refused() -> None:
    w13q, _, w2q, _ = quantize_experts(*_float_experts(40, 24, seed=1), blocked=False)
    with pytest.raises(ValueError, match="unscaled weights must have the activations' dtype"):
        fused_moe.fused_expert_outputs(torch.zeros(2, 40), _ids(2, 2, 1), w13q, w2q)


def test_a_k_tile_that_would_straddle_scale_blocks_is_refused() -> None:
    w13q, w13s, w2q, w2s = quantize_experts(*_float_experts(136, 72, seed=2), blocked=True)
    odd = MoeKernelConfig(16, GemmTile(32, 96, 4, 2), GemmTile(32, 96, 4, 2))
    with pytest.raises(ValueError, match="block_k 96 does not divide 128"):
        fused_moe.fused_expert_outputs(torch.zeros(2, 136), _ids(2, 2, 1), w13q, w2q, odd, w13_scale=w13s,
                                       w2_scale=w2s)
