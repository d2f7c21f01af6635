"""DeepSeek-V2/V3 as configuration: MLA fields, yarn + mscale, grouped routing against transformers' routers,
the latent cache's bytes per token, dummy weights from a config.json alone.

Whole-model agreement with transformers is in test_model_parity.py (logits) and
tests/integration/test_moe_vs_hf.py (greedy tokens through the engine).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig, YarnScaling
from engine.errors import ConfigError
from engine.kv_cache import KVCacheSpec, KVLayout, kv_cache_spec_for
from engine.layers.moe_ops import route_tokens_grouped
from engine.loader.dummy import dummy_weights
from engine.models.llama import LlamaForCausalLM
from engine.moe_config import GroupScore, RouterScoring
from tests.support.required import require_module

# DeepSeek-V2-Lite's config.json (the fields the engine reads), and DeepSeek-V3's routing fields.
V2_LITE_HF = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
    "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
}
V3_ROUTING = {"architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": 1536, "n_routed_experts": 256,
              "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3}


def test_v2_lite_config_reads_mla_yarn_and_its_dense_first_layer() -> None:
    config = ModelConfig.from_hf_config(V2_LITE_HF)
    assert config.mla is not None and config.moe is not None and config.moe.grouped is not None
    assert (config.mla.kv_lora_rank, config.mla.latent_dim, config.mla.q_lora_rank) == (512, 576, None)
    assert config.head_dim == 64 and config.num_kv_heads == 16  # the rotary dim; every head its own k/v
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert config.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert config.rope_scaling == YarnScaling(factor=40.0, original_max_position_embeddings=4096,
                                              attention_factor=1.0)
    assert config.moe.sparse_layers == tuple(range(1, 27))
    assert config.moe.shared_expert_intermediate_size == 2 * 1408 and not config.moe.shared_expert_gated
    assert config.moe.grouped.scoring is RouterScoring.SOFTMAX and config.moe.grouped.num_groups == 1
    assert not config.moe.renormalize and not config.moe.grouped.score_correction_bias


def test_v3_config_routes_by_biased_sigmoid_groups() -> None:
    config = ModelConfig.from_hf_config({**V2_LITE_HF, **V3_ROUTING})
    assert config.moe is not None and config.moe.grouped is not None and config.mla is not None
    routing = config.moe.grouped
    assert routing.scoring is RouterScoring.SIGMOID and routing.group_score is GroupScore.TOP2_SUM
    assert (routing.num_groups, routing.topk_groups, routing.routed_scaling_factor) == (8, 4, 2.5)
    assert routing.score_correction_bias and config.moe.renormalize and config.mla.rope_interleaved
    assert config.moe.sparse_layers[0] == 3


def test_bad_grouping_and_unshardable_mla_heads_are_rejected() -> None:
    with pytest.raises(ConfigError, match="n_group"):
        ModelConfig.from_hf_config({**V2_LITE_HF, **V3_ROUTING, "n_group": 3})
    with pytest.raises(ConfigError, match="topk_group"):
        ModelConfig.from_hf_config({**V2_LITE_HF, **V3_ROUTING, "topk_group": 9})
    from engine.parallel.group import check_tensor_parallel

    check_tensor_parallel(ModelConfig.from_hf_config(V2_LITE_HF), 2)  # 16 heads: TP shards them
    with pytest.raises(ConfigError, match=r"num_heads \(16\) is not divisible by tensor_parallel_size \(3\)"):
        check_tensor_parallel(ModelConfig.from_hf_config(V2_LITE_HF), 3)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_grouped_routing_matches_transformers_router(version: str) -> None:
    transformers = require_module("transformers")
    experts, hidden = 16, 24
    kwargs = dict(hidden_size=hidden, num_attention_heads=4, n_routed_experts=experts, num_experts_per_tok=3,
                  n_group=4, topk_group=2, routed_scaling_factor=1.7)
    if version == "v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as Router

        hf_config = transformers.DeepseekV2Config(**kwargs, topk_method="group_limited_greedy")
        arch = "DeepseekV2ForCausalLM"
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router

        hf_config = transformers.DeepseekV3Config(**kwargs, norm_topk_prob=True)
        arch = "DeepseekV3ForCausalLM"
    gen = torch.Generator().manual_seed(7)
    router = Router(hf_config)
    router.weight.data.copy_(torch.randn(experts, hidden, generator=gen))
    if version == "v3":
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.5)
    x = torch.randn(32, hidden, generator=gen)
    _, hf_weights, hf_ids = router(x)
    moe = ModelConfig.from_hf_config({**V2_LITE_HF, **hf_config.to_dict(), "architectures": [arch]}).moe
    assert moe is not None and moe.grouped is not None
    bias = router.e_score_correction_bias if version == "v3" else None
    ours = route_tokens_grouped(x @ router.weight.T, 3, moe.renormalize, moe.grouped, bias)
    order_hf, order_ours = hf_ids.sort(dim=1), ours.expert_ids.sort(dim=1)
    assert torch.equal(order_ours.values, order_hf.values)
    torch.testing.assert_close(ours.weights.gather(1, order_ours.indices), hf_weights.gather(1, order_hf.indices))


def test_latent_cache_holds_one_576_wide_vector_per_token_and_layer() -> None:
    """DeepSeek-V2-Lite in bf16 against Llama-3-8B's GQA cache (8 KV heads of 128, 32 layers)."""
    config = ModelConfig.from_hf_config(V2_LITE_HF)
    assert config.mla is not None
    latent = kv_cache_spec_for(27, config.num_kv_heads, config.head_dim, config.mla.latent_dim, 16, "bfloat16")
    gqa = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert latent.layout is KVLayout.LATENT and latent.block_shape == (27, 1, 16, 1, 576)
    assert latent.bytes_per_token == 27 * 576 * 2 == 31_104 and gqa.bytes_per_token == 131_072
    assert latent.allocate(2, "cpu").shape == (2, 27, 1, 16, 1, 576)
    assert latent.fingerprint() != KVCacheSpec(27, 1, 576, 16, "bfloat16").fingerprint()
    with pytest.raises(ConfigError, match="one head"):
        KVCacheSpec(27, 2, 576, 16, "bfloat16", KVLayout.LATENT)


def test_dummy_weights_load_a_deepseek_model_from_its_config_alone() -> None:
    tiny = {**V2_LITE_HF, **V3_ROUTING, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 3, "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1}
    config = ModelConfig.from_hf_config(tiny)
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    model.load_weights(dummy_weights(config, torch.float32))  # every parameter covered exactly, or it raises
    assert model.model.layers[1].self_attn.q_b_proj is not None


def test_v2_lite_parameter_counts_match_its_model_card() -> None:
    """15.7B held, 2.4B activated per token (DeepSeek's count leaves the embedding lookup out): what the
    benchmarks' floors and `baton plan`'s cost model read."""
    from engine.param_count import count_parameters

    params = count_parameters(ModelConfig.from_hf_config(V2_LITE_HF))
    assert params.total / 1e9 == pytest.approx(15.71, abs=0.01)
    assert (params.active - params.embedding) / 1e9 == pytest.approx(2.45, abs=0.01)
