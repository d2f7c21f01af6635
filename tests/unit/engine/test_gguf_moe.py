"""MoE families from GGUF files: llama.cpp's metadata and stacked expert tensors, read back per expert.

Each test writes a GGUF file the way llama.cpp's converter lays one out (gguf's own name table,
`blk.N.ffn_{gate,up,down}_exps` holding all of a layer's experts as `[E, rows, cols]`, Mixtral as a
"llama" file with its q/k rows permuted) from a tiny checkpoint made by `transformers`, then checks that
the GGUF path yields the checkpoint's config and exactly its tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import ModelConfig
from engine.loader.weights import load_model_config, load_model_weights
from tests.support.tiny_moe import save_tiny_moe

_EXPERT = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")
GGUF_ARCH = {"qwen3-moe": "qwen3moe", "mixtral": "llama", "qwen2-moe-shared-expert": "qwen2moe"}


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` of q/k rows (the inverse of our `unpermute_rotary`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(family: str, model_dir: Path, path: Path) -> None:
    config = ModelConfig.from_dir(model_dir)
    arch = GGUF_ARCH[family]
    moe = config.moe
    assert moe is not None
    writer = gguf.GGUFWriter(path, arch)
    for key, value in {"block_count": config.num_layers, "context_length": config.max_position_embeddings,
                       "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
                       "attention.head_count": config.num_heads, "attention.head_count_kv": config.num_kv_heads,
                       "attention.key_length": config.head_dim, "vocab_size": config.vocab_size,
                       "expert_count": moe.num_experts, "expert_used_count": moe.top_k}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if arch != "llama":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", moe.intermediate_size)
    if moe.has_shared_expert:
        writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", moe.shared_expert_intermediate_size)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    for name, tensor in gguf_tensors(config, arch, dict(load_model_weights(model_dir, "safetensors", config,
                                                                           torch.float32))).items():
        writer.add_tensor(name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_tensors(config: ModelConfig, arch: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    table = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_layers)
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        expert = _EXPERT.match(name)
        if expert:
            key = table.get_name(f"{expert.group(1)}.{expert.group(3)}.weight", try_suffixes=(".weight",))
            stacks.setdefault(key, {})[int(expert.group(2))] = tensor
            continue
        if arch == "llama" and ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_kv_heads)
        out[table.get_name(name, try_suffixes=(".weight", ".bias"))] = tensor
    for key, experts in stacks.items():
        out[key] = torch.stack([experts[e] for e in sorted(experts)])
    return out


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_moe_config_and_weights_equal_the_checkpoints(family: str, tmp_path: Path) -> None:
    model_dir = save_tiny_moe(family, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_gguf(family, model_dir, path)
    expected_config = ModelConfig.from_dir(model_dir)
    config = load_model_config(path, "gguf")
    assert config.architecture == expected_config.architecture and config.moe == expected_config.moe
    expected = dict(load_model_weights(model_dir, "safetensors", expected_config, torch.float32))
    got = dict(load_model_weights(path, "gguf", config, torch.float32))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
