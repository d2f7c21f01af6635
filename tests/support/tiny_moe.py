"""Tiny seeded random mixture-of-experts checkpoints, made with `transformers` at test time.

Each family is a 2-layer model of hidden size 64 whose experts are a few KB: what the engine must
match `transformers` on (routing, renormalisation, shared expert, the checkpoint's expert names). A
checkpoint is written with `save_pretrained`, so it is in the Hugging Face Hub's layout (per-expert
tensors, Mixtral's `block_sparse_moe.experts.{e}.w1`), the one real checkpoints have. With the default
model's tokenizer copied in (vocab 49152, tied embeddings: ~13 MB), a directory serves as a model
of its own (`baton worker --model DIR`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tests.support.required import require_module

SMALL: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6)
_MLA: dict[str, Any] = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
_YARN: dict[str, Any] = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=1.0)
# family -> (transformers config class, its kwargs beyond SMALL, which they override)
TINY_MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, head_dim=32)),
    "qwen3-moe-dense-layer-no-renorm": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3,
                                                               moe_intermediate_size=32, norm_topk_prob=False,
                                                               decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48)),
    # DeepSeek-V2 (MLA without q_lora, like V2-Lite; softmax grouped routing; a dense first layer; yarn
    # rope with DeepSeek's mscale on the softmax scale) and V3 (q_lora, sigmoid routing + correction
    # bias, renormalised and scaled).
    "deepseek-v2": ("DeepseekV2Config", dict(**_MLA, q_lora_rank=None, n_routed_experts=8, n_shared_experts=1,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=1.5, rope_parameters=_YARN)),
    "deepseek-v3": ("DeepseekV3Config", dict(**_MLA, q_lora_rank=24, n_routed_experts=8, n_shared_experts=1,
                                             n_group=4, topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5)),
}
_TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def build_tiny_moe(family: str, vocab_size: int, tie_word_embeddings: bool = False) -> torch.nn.Module:
    """A `transformers` model of the family with seeded random weights (norms and all, see `randomize`)."""
    transformers = require_module("transformers")
    config_cls, kwargs = TINY_MOE_FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**{**SMALL, **kwargs}, vocab_size=vocab_size,
                                                  tie_word_embeddings=tie_word_embeddings)
    hf_config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    randomize(model)
    return model


def randomize(model: torch.nn.Module) -> None:
    """HF's init gives unit norms and a zero router, which would hide a missing norm or a wrong routing."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else 0.15))


def save_tiny_moe(family: str, out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write the family's tiny checkpoint to `out_dir`; with `tokenizer_dir`, a servable model with its
    tokenizer (vocabulary sized to it, tied embeddings to keep the file small)."""
    vocab = 49152 if tokenizer_dir is not None else 160
    build_tiny_moe(family, vocab, tie_word_embeddings=tokenizer_dir is not None).save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir
