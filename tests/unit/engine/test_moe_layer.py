"""The MoE block's parts on their own: routing, the reference expert compute, the config, loading.

Whole-model agreement with transformers (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert) is in
test_model_parity.py; the fused kernel against the reference in tests/unit/kernels/test_moe_interpret.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig
from engine.errors import ConfigError, ModelLoadError
from engine.layers.moe_ops import combine_expert_outputs, expert_outputs_reference, route_tokens
from engine.loader.dummy import dummy_weights, hf_parameter_shapes
from engine.models.llama import LlamaForCausalLM
from engine.moe_config import MIXTRAL_EXPERT_NAMES, MoeConfig, moe_config_from_hf

QWEN3_MOE_HF = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "num_experts": 6, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "norm_topk_prob": True}
MIXTRAL_HF = {**QWEN3_MOE_HF, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4}


def test_routing_keeps_the_top_k_softmax_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    routing = route_tokens(logits, top_k=2, renormalize=False)
    assert routing.expert_ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(routing.weights, torch.softmax(logits, -1).gather(1, routing.expert_ids))


def test_renormalised_routing_is_a_softmax_over_the_top_k_logits() -> None:
    """Mixtral's formulation (softmax of the chosen logits) and Qwen's norm_topk_prob are the same."""
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    routing = route_tokens(logits, top_k=3, renormalize=True)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(5))
    torch.testing.assert_close(routing.weights, torch.softmax(logits.gather(1, routing.expert_ids), -1))


def test_reference_experts_and_combine_equal_a_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts = 6, 12, 8, 4
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    routing = route_tokens(torch.randn(tokens, experts, generator=gen), top_k=2, renormalize=False)
    got = combine_expert_outputs(expert_outputs_reference(x, routing.expert_ids, w13, w2), routing.weights)
    for t in range(tokens):
        expected = sum(w * F.linear(F.silu(x[t] @ w13[e, :inter].T) * (x[t] @ w13[e, inter:].T), w2[e])
                       for w, e in zip(routing.weights[t], routing.expert_ids[t].tolist(), strict=True))
        torch.testing.assert_close(got[t], expected, rtol=1e-5, atol=1e-5)


def test_qwen3_moe_config_reads_sparse_layers_and_renormalisation() -> None:
    moe = moe_config_from_hf("Qwen3MoeForCausalLM", {**QWEN3_MOE_HF, "decoder_sparse_step": 2,
                                                     "mlp_only_layers": [3]})
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (6, 2, 16)
    assert moe.renormalize and moe.sparse_layers == (1,) and not moe.has_shared_expert
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    alias = {k: v for k, v in QWEN3_MOE_HF.items() if k != "num_experts"} | {"num_local_experts": 5}
    assert ModelConfig.from_hf_config(alias).moe.num_experts == 5  # type: ignore[union-attr]


def test_mixtral_config_always_renormalises_and_uses_its_own_weight_names() -> None:
    config = ModelConfig.from_hf_config(MIXTRAL_HF)
    assert config.moe is not None and config.moe.renormalize and config.moe.names == MIXTRAL_EXPERT_NAMES
    assert config.moe.intermediate_size == 48 and config.moe.sparse_layers == (0, 1, 2, 3)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hf_parameter_shapes(config)


def test_dense_families_have_no_moe_and_bad_moe_configs_are_rejected() -> None:
    assert ModelConfig.from_hf_config({**QWEN3_MOE_HF, "architectures": ["Qwen3ForCausalLM"]}).moe is None
    with pytest.raises(ConfigError, match="top_k"):
        MoeConfig(num_experts=2, top_k=3, intermediate_size=8, renormalize=True, sparse_layers=(0,))
    with pytest.raises(ConfigError, match="num_experts"):
        ModelConfig.from_hf_config({k: v for k, v in QWEN3_MOE_HF.items() if k != "num_experts"})
    with pytest.raises(ConfigError, match="out of range"):
        dataclasses.replace(ModelConfig.from_hf_config(QWEN3_MOE_HF), num_layers=2)


def _model(config: ModelConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, TorchAttentionBackend())


def test_missing_expert_weight_is_named() -> None:
    config = ModelConfig.from_hf_config(MIXTRAL_HF)
    weights = dict(dummy_weights(config, torch.float32))
    del weights["model.layers.2.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(ModelLoadError, match=r"layers\.2\.block_sparse_moe\.experts\.1\.w3"):
        _model(config).load_weights(weights.items())


def test_wrong_expert_shape_and_unknown_expert_are_rejected() -> None:
    config = ModelConfig.from_hf_config(QWEN3_MOE_HF)
    weights = dict(dummy_weights(config, torch.float32))
    weights["model.layers.0.mlp.experts.2.down_proj.weight"] = torch.zeros(32, 15)
    with pytest.raises(ModelLoadError, match=r"experts\.2\.down_proj.*\(32, 15\)"):
        _model(config).load_weights(weights.items())
    weights = dict(dummy_weights(config, torch.float32))
    weights["model.layers.0.mlp.experts.6.up_proj.weight"] = torch.zeros(16, 32)  # only 6 experts
    with pytest.raises(ModelLoadError, match=r"experts\.6\.up_proj"):
        _model(config).load_weights(weights.items())


def test_experts_load_stacked_per_projection() -> None:
    """Expert e's gate/up rows land in w13[e] (gate first), its down weight in w2[e]: one tensor per
    projection, sliceable along experts (what expert parallelism shards)."""
    config = ModelConfig.from_hf_config(QWEN3_MOE_HF)
    weights = dict(dummy_weights(config, torch.float32, seed=3))
    model = _model(config)
    model.load_weights(weights.items())
    experts = model.model.layers[1].mlp.experts
    p = "model.layers.1.mlp.experts.4."
    assert experts.w13.shape == (6, 32, 32) and experts.w2.shape == (6, 32, 16)
    assert torch.equal(experts.w13[4], torch.cat([weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]]))
    assert torch.equal(experts.w2[4], weights[p + "down_proj.weight"])


def test_dummy_moe_model_generates_the_same_tokens_twice(tmp_path: Path) -> None:
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_HF))
    runs = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", cache=CacheConfig(num_blocks=32)))
        runs.append(engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    assert len(runs[0][0]) == 6 and runs[0] == runs[1]
