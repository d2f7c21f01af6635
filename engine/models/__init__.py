"""Model registry: HF `architectures[0]` -> implementation class. Every family is the one Llama model."""

from __future__ import annotations

import importlib

from torch import nn

from engine.errors import ConfigError

_REGISTRY = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:LlamaForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an HF architecture name; the model module is imported only when asked for."""
    if architecture not in _REGISTRY:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: {', '.join(_REGISTRY)}")
    module_name, cls_name = _REGISTRY[architecture].split(":")
    cls: type[nn.Module] = getattr(importlib.import_module(module_name), cls_name)
    return cls
