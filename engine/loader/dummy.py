"""The Llama family's parameter names and shapes (MoE families included), and deterministic random
weights from a config alone.

Dummy weights let GPU benchmarks run a 70B-shaped model from its `config.json` without downloading it.
Every tensor is drawn directly on the target device in the target dtype (`Tensor.normal_` in place),
so no fp32 or host copy of a huge model ever exists. Each tensor's generator is seeded from the run
seed and the tensor's name, so a tensor's values do not depend on load order or on which other
tensors were requested (two workers, or a sharded load, see the same weights).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from engine.config import ModelConfig
from engine.mla_config import mla_hf_shapes
from engine.moe_config import moe_block_hf_shapes

DUMMY_STD = 0.02  # the HF `initializer_range` default; keeps activations finite through deep stacks


def hf_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama-family checkpoint holds, by Hugging Face name, in load order."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if config.mla is not None:
            attn = mla_hf_shapes(config.mla, h, config.num_heads)
            shapes.update({f"{p}self_attn.{name}": shape for name, shape in attn.items()})
        else:
            _add_gqa_shapes(shapes, p, config)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.moe is not None and config.is_sparse_layer(i):
            block = f"{p}{config.moe.names.block}."
            shapes.update({block + name: shape for name, shape in moe_block_hf_shapes(config.moe, h).items()})
            continue
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _add_gqa_shapes(shapes: dict[str, tuple[int, ...]], p: str, config: ModelConfig) -> None:
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
    shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
    shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
    if config.attention_bias:
        shapes[p + "self_attn.q_proj.bias"] = (q_out,)
        shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
        shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
    if config.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
    shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
    if config.o_proj_bias:
        shapes[p + "self_attn.o_proj.bias"] = (h,)


def is_norm_weight(name: str) -> bool:
    return name.endswith(("layernorm.weight", "norm.weight"))


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)`: norms are ones, biases zeros, matrices normal(0, DUMMY_STD)."""
    device = torch.device(device)
    for name, shape in hf_parameter_shapes(config).items():
        if is_norm_weight(name):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed(_tensor_seed(seed, name))
            tensor = torch.empty(shape, dtype=dtype, device=device)
            yield name, tensor.normal_(0.0, DUMMY_STD, generator=generator)


def _tensor_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes (unlike hash(), which is salted per interpreter).
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)
