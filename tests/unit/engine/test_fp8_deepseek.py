"""DeepSeek-V3's FP8 checkpoint layout on CPU: a tiny V3 (MLA with q_lora, sigmoid grouped routing, shared
experts, a dense first layer, DeepSeek's interleaved rope) written as the hub files are
(tests/support/fp8_checkpoints.py: every linear in e4m3 with a 128 x 128 block `weight_scale_inv`).

It loads FP8 (experts and projections e4m3; kv_b_proj dequantized at load: engine/layers/mla.py says why)
and greedy-decodes the tokens of the same model loaded with the dequantized weights, prompts prefilled in
chunks small enough for every FP8 projection to run weight-only.

Logit tolerance: steps of <= 16 tokens run every FP8 projection weight-only (experts always are) and the
CPU reference multiplies the same dequantized values in float32, so the logits agree to 1e-4 of the
logit scale at every step (measured: bit-identical). A prefill of more tokens quantizes the activations
of attention, the dense MLP and the shared expert per token and 128-group (the FP8 GEMM's large-M path,
engine/quant/fp8.py; the routed experts stay weight-only): ||fp8 - ref|| / ||ref|| measured 0.115 on
these random weights (0.11 for the dense FP8 tests' block checkpoint), bounded at 0.15.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.loader import load_model_weights
from engine.models.llama import LlamaForCausalLM
from engine.quant.fp8 import FP8_DTYPE, WEIGHT_ONLY_MAX_ROWS
from tests.support.fp8_checkpoints import HF_CONFIG, write_deepseek_v3_fp8
from tests.unit.engine.paged_harness import PagedHarness
from tests.unit.engine.test_fp8_checkpoints import _load

PROMPTS = ([5, 17, 3, 88, 42, 7, 19, 60, 2, 33, 91, 14, 150, 8, 77, 23, 64, 5, 120, 9], [33, 1, 90, 45, 12])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the FP8 directory, the float32 weights its tensors stand for)."""
    path = tmp_path_factory.mktemp("deepseek-v3-fp8")
    return path, write_deepseek_v3_fp8(path)


def _reference(meaning: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_hf_config(HF_CONFIG), TorchAttentionBackend())
    model.load_weights(meaning.items())
    return model.eval()


@torch.no_grad()
def _greedy(model: LlamaForCausalLM) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per prompt, prompts prefilled in chunks of at most WEIGHT_ONLY_MAX_ROWS tokens per step
    (so every FP8 projection runs weight-only); and the last position's logits of every step, stacked."""
    harness = PagedHarness(model, model.config, block_size=4, num_blocks=64)
    chunk = WEIGHT_ONLY_MAX_ROWS // len(PROMPTS)
    fed = {str(i): 0 for i in range(len(PROMPTS))}
    out: dict[str, list[int]] = {rid: [] for rid in fed}
    steps: list[torch.Tensor] = []
    while len(out["0"]) < NEW_TOKENS:
        batch = [(rid, PROMPTS[int(rid)][fed[rid]:fed[rid] + chunk] if fed[rid] < len(PROMPTS[int(rid)])
                  else out[rid][-1:]) for rid in fed]
        logits = harness.step(batch)
        for rid, piece in batch:
            fed[rid] += len(piece)
            if fed[rid] >= len(PROMPTS[int(rid)]):
                out[rid].append(int(logits[rid][-1].argmax()))
        steps.append(torch.stack([logits[rid][-1] for rid in fed]))
    return [out[rid][:NEW_TOKENS] for rid in fed], torch.stack(steps)


@torch.no_grad()
def _prefill_logits(model: LlamaForCausalLM, max_tokens: int = 20) -> torch.Tensor:
    """Every position's logits of both prompts (their first `max_tokens` each) prefilled in one step: 25 tokens
    by default, the FP8 GEMMs' large-M path."""
    harness = PagedHarness(model, model.config, block_size=4, num_blocks=64)
    logits = harness.step([(str(i), p[:max_tokens]) for i, p in enumerate(PROMPTS)])
    return torch.cat([logits[str(i)] for i in range(len(PROMPTS))])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_deepseek_v3_fp8_checkpoint_loads_its_experts_and_projections_in_e4m3(checkpoint: tuple) -> None:
    path, meaning = checkpoint
    model = _load(path)
    attn, block = model.model.layers[1].self_attn, model.model.layers[1].mlp
    for linear in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj):
        assert linear.weight.dtype == FP8_DTYPE and linear.weight_scale.dim() == 2
    assert block.experts.w13.dtype == block.experts.w2.dtype == FP8_DTYPE
    assert block.experts.w13_scale.shape == (8, 2 * 2, 2)  # I = 192: two blocks for the gate, two for the up
    assert block.shared_expert.gate_up_proj.weight.dtype == FP8_DTYPE
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE  # the dense first layer
    assert attn.kv_b_proj.weight.dtype == torch.float32  # dequantized at load, exactly
    assert torch.equal(attn.kv_b_proj.weight, meaning["model.layers.1.self_attn.kv_b_proj.weight"])


def test_deepseek_v3_fp8_greedy_tokens_equal_the_dequantized_models(checkpoint: tuple) -> None:
    path, meaning = checkpoint
    tokens, logits = _greedy(_load(path))
    ref_tokens, ref_logits = _greedy(_reference(meaning))
    assert len({tuple(t) for t in ref_tokens}) > 1 and len(set(ref_tokens[0])) > 1  # tokens that say something
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()


def test_deepseek_v3_fp8_prefill_logits_are_within_the_activation_rounding(checkpoint: tuple) -> None:
    path, meaning = checkpoint
    logits, ref_logits = _prefill_logits(_load(path)), _prefill_logits(_reference(meaning))
    assert _rel(logits, ref_logits) <= 0.15


def test_an_fp8_kv_b_proj_without_its_scale_is_refused(checkpoint: tuple, tmp_path: Path) -> None:
    path, _ = checkpoint
    config = ModelConfig.from_dir(path)
    weights = (item for item in load_model_weights(path, "safetensors", config, "float32")
               if item[0] != "model.layers.0.self_attn.kv_b_proj.weight_scale_inv")
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    assert config.fp8 is not None
    model.use_fp8(config.fp8)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.kv_b_proj: FP8 weight without its scale"):
        model.load_weights(weights)


def test_interleaved_rope_rows_straddling_a_scale_block_are_refused(tmp_path: Path) -> None:
    """kv_lora_rank 120: kv_a_proj_with_mqa's rotary rows 120..135 cross the 128-row scale boundary, so
    reordering them would move rows between blocks of different scales."""
    write_deepseek_v3_fp8(tmp_path, kv_lora_rank=120)
    with pytest.raises(ModelLoadError, match=r"kv_a_proj_with_mqa: rotary rows 120\.\.135 straddle two 128-row"):
        _load(tmp_path)


def test_online_fp8_on_deepseek_v3_quantizes_everything_but_kv_b_proj(tmp_path: Path) -> None:
    meaning = write_deepseek_v3_fp8(tmp_path, quantized=False)
    model = _load(tmp_path, quantization="fp8")
    attn, experts = model.model.layers[1].self_attn, model.model.layers[1].mlp.experts
    assert attn.q_b_proj.weight.dtype == experts.w2.dtype == FP8_DTYPE and experts.w2_scale.shape == (8, 256)
    assert torch.equal(attn.kv_b_proj.weight, meaning["model.layers.1.self_attn.kv_b_proj.weight"])
    chunk = WEIGHT_ONLY_MAX_ROWS // len(PROMPTS)  # 13 tokens: weight-only, no activation rounding
    logits, ref_logits = _prefill_logits(model, chunk), _prefill_logits(_reference(meaning), chunk)
    # Every weight rounded to e4m3 per output channel, which can also flip a token's expert choice: 0.115
    # measured on these random weights (the dense tests' online error is ~0.15 too).
    assert _rel(logits, ref_logits) <= 0.2
