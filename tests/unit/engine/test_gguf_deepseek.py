"""DeepSeek from GGUF: a tiny DeepSeek-V3 (q_lora, sigmoid grouped routing with its bias, a shared expert, a
dense first layer) written the way llama.cpp's converter writes `deepseek2` files (kv_b_proj split into
`attn_k_b` (transposed) and `attn_v_b`, stacked experts, `exp_probs_b`, MLA dims as metadata) must load as
the checkpoint's config and tensors, and greedy decoding must give `transformers`' tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import ModelConfig
from engine.loader.weights import load_model_config, load_model_weights
from engine.models.llama import LlamaForCausalLM
from tests.support.required import require_module
from tests.support.tiny_moe import save_tiny_moe
from tests.unit.engine.paged_harness import PagedHarness
from tests.unit.engine.test_gguf_moe import gguf_tensors

PROMPT = [5, 17, 3, 88, 42, 7, 19, 60, 2, 33, 1]
NEW_TOKENS = 8


def _metadata(config: ModelConfig) -> dict[str, int | float | bool]:
    mla, moe = config.mla, config.moe
    assert mla is not None and moe is not None and moe.grouped is not None
    return {"block_count": config.num_layers, "context_length": config.max_position_embeddings,
            "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
            "attention.head_count": config.num_heads, "attention.head_count_kv": 1,
            "attention.key_length": mla.latent_dim, "attention.value_length": mla.kv_lora_rank,
            "attention.key_length_mla": mla.qk_head_dim, "attention.value_length_mla": mla.v_head_dim,
            "rope.dimension_count": mla.qk_rope_head_dim, "attention.kv_lora_rank": mla.kv_lora_rank,
            "attention.q_lora_rank": mla.q_lora_rank or 0, "leading_dense_block_count": moe.sparse_layers[0],
            "vocab_size": config.vocab_size, "expert_count": moe.num_experts, "expert_used_count": moe.top_k,
            "expert_feed_forward_length": moe.intermediate_size,
            "expert_shared_count": moe.shared_expert_intermediate_size // moe.intermediate_size,
            "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID.value,
            "expert_group_count": moe.grouped.num_groups, "expert_group_used_count": moe.grouped.topk_groups,
            "expert_weights_scale": moe.grouped.routed_scaling_factor, "expert_weights_norm": moe.renormalize,
            "attention.layer_norm_rms_epsilon": config.rms_norm_eps, "rope.freq_base": config.rope_theta}


def write_deepseek_gguf(model_dir: Path, path: Path) -> None:
    config = ModelConfig.from_dir(model_dir)
    assert config.mla is not None
    writer = gguf.GGUFWriter(path, "deepseek2")
    for key, value in _metadata(config).items():
        if isinstance(value, bool):
            writer.add_bool(f"deepseek2.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"deepseek2.{key}", value)
        else:
            writer.add_uint32(f"deepseek2.{key}", value)
    weights = dict(load_model_weights(model_dir, "safetensors", config, torch.float32))
    heads, nope, v = config.num_heads, config.mla.qk_nope_head_dim, config.mla.v_head_dim
    split = {}
    for name in [n for n in weights if n.endswith("kv_b_proj.weight")]:  # as the converter splits it
        k_b, v_b = weights.pop(name).view(heads, nope + v, -1).split([nope, v], dim=1)
        split[name.replace("kv_b_proj", "k_b_proj")] = k_b.transpose(1, 2)
        split[name.replace("kv_b_proj", "v_b_proj")] = v_b
    weights = {n.replace("e_score_correction_bias", "e_score_correction.bias"): t for n, t in weights.items()}
    stored = {**gguf_tensors(config, "deepseek2", weights), **gguf_tensors(config, "deepseek2", split)}
    for name, tensor in stored.items():
        writer.add_tensor(name, tensor.contiguous().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("deepseek-gguf")
    model_dir = save_tiny_moe("deepseek-v3", root / "hf")
    write_deepseek_gguf(model_dir, root / "model.gguf")
    return model_dir, root / "model.gguf"


def test_gguf_config_and_weights_equal_the_checkpoints(files: tuple[Path, Path]) -> None:
    model_dir, path = files
    expected_config, config = ModelConfig.from_dir(model_dir), load_model_config(path, "gguf")
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert (config.mla, config.moe) == (expected_config.mla, expected_config.moe)
    expected = dict(load_model_weights(model_dir, "safetensors", expected_config, torch.float32))
    got = dict(load_model_weights(path, "gguf", config, torch.float32))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_greedy_tokens_from_the_gguf_equal_transformers(files: tuple[Path, Path]) -> None:
    model_dir, path = files
    config = load_model_config(path, "gguf")
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    model.load_weights(load_model_weights(path, "gguf", config, torch.float32))
    harness, tokens = PagedHarness(model.eval(), config), []
    logits = harness.step([("a", PROMPT)])["a"]
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits[-1].argmax()))
        logits = harness.step([("a", tokens[-1:])])["a"]
    transformers = require_module("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(PROMPT):]
    assert tokens == expected.tolist()
