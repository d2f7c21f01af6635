"""Parameter counts: total (what is stored) and active (what one token runs), for dense and MoE families."""

from __future__ import annotations

import pytest

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.param_count import count_parameters
from lab.micro.bench_decode import LLAMA31_8B, decode_bytes
from lab.micro.bench_moe import QWEN3_30B_A3B, SMOKE

MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize(("hf", "total_b", "active_b"), [
    (QWEN3_30B_A3B, 30.53, 3.35),  # the model card: 30.5B total, 3.3B activated
    (MIXTRAL_8X7B, 46.70, 12.88),  # Mistral's figures: 46.7B total, 12.9B active
    (LLAMA31_8B, 8.03, 8.03),  # dense: every parameter is active
])
def test_published_totals_and_active_counts(hf: dict, total_b: float, active_b: float) -> None:
    params = count_parameters(ModelConfig.from_hf_config(hf))
    assert params.total / 1e9 == pytest.approx(total_b, abs=0.01)
    assert params.active / 1e9 == pytest.approx(active_b, abs=0.01)


def test_total_equals_the_models_own_parameters() -> None:
    config = ModelConfig.from_hf_config(SMOKE)
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    assert count_parameters(config).total == sum(p.numel() for p in model.parameters())


def test_decode_reads_only_the_experts_the_batch_routed_to() -> None:
    config = ModelConfig.from_hf_config(QWEN3_30B_A3B)
    params = count_parameters(config)
    one_token, _ = decode_bytes(config, 1, 1024, 1, experts_routed_per_layer=8)
    every_expert, _ = decode_bytes(config, 1, 1024, 1)
    assert every_expert - one_token == pytest.approx((params.routed_experts - 48 * 8 * params.expert) * 2)
    assert one_token / 1e9 == pytest.approx(2 * (params.active - params.embedding) / 1e9, abs=0.01)
