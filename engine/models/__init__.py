"""Model registry: HF `architectures[0]` -> implementation class. Every family is the one Llama model
(the MoE families too: their sparse MLPs are a `ModelConfig.moe` field, DeepSeek's latent attention
`ModelConfig.mla`)."""

from __future__ import annotations

import importlib

from torch import nn

from engine.errors import ConfigError

_REGISTRY = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "DeepseekV2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "DeepseekV3ForCausalLM": "engine.models.llama:LlamaForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an HF architecture name; the model module is imported only when asked for."""
    if architecture not in _REGISTRY:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(_REGISTRY)}")
    module_name, cls_name = _REGISTRY[architecture].split(":")
    cls: type[nn.Module] = getattr(importlib.import_module(module_name), cls_name)
    return cls
