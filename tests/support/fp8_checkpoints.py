"""A tiny DeepSeek-V3 checkpoint in the hub's FP8 layout, for the CPU tests and the GPU tests alike.

Every linear of attention, the dense MLP, the routed and the shared experts is stored in e4m3 with a
128 x 128 block `weight_scale_inv`, as DeepSeek-V3's published files are; the router, norms, embeddings
and LM head are unquantized. Widths make projections span several scale blocks: expert intermediate
192 (the gate's and the up's blocks apart), two shared experts (384: aligned), q_b_proj's rotary rows in
two blocks, DeepSeek's interleaved rope (`rope_interleave` defaults to true for V3).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.loader.dummy import dummy_weights
from engine.quant.fp8 import dequantize_blocks, quantize_blocks

HF_CONFIG = {  # DeepSeek-V3 in miniature (MLA with q_lora, sigmoid grouped routing)
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 160, "hidden_size": 256, "intermediate_size": 384,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
    "kv_lora_rank": 160, "q_lora_rank": 136, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 192,
    "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}
BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def is_stored_fp8(name: str) -> bool:
    """What DeepSeek-V3's hub checkpoint stores in FP8: every `*_proj` linear (kv_a_proj_with_mqa too); not
    the router `mlp.gate`."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def store_block_fp8(name: str, weight: torch.Tensor, tensors: dict[str, torch.Tensor],
                    meaning: dict[str, torch.Tensor]) -> None:
    """Add `name` (a `*.weight`) to a checkpoint's `tensors` as the hub's block format stores it (e4m3 plus
    `weight_scale_inv`), and the float32 values those stand for to `meaning`."""
    q, s = quantize_blocks(weight)
    meaning[name] = dequantize_blocks(q, s)
    base = name.removesuffix(".weight")
    tensors.update({f"{base}.weight": q, f"{base}.weight_scale_inv": s})


def write_deepseek_v3_fp8(path: Path, quantized: bool = True, **overrides: object) -> dict[str, torch.Tensor]:
    """Write the checkpoint (config.json + model.safetensors; `overrides`: config fields) into `path`, FP8 or
    (`quantized=False`) float32; return the float32 weights its tensors stand for, by HF name."""
    hf_config = {**HF_CONFIG, **overrides}
    tensors, meaning = {}, {}
    for name, w in dummy_weights(ModelConfig.from_hf_config(hf_config), torch.float32, seed=3):
        if w.dim() == 2:  # well-spread values, so routing and logits depend on every weight
            w = torch.randn(w.shape, generator=torch.Generator().manual_seed(len(name) * 7 + w.shape[0])) * 0.1
        elif "norm" in name:
            w = torch.rand(w.shape, generator=torch.Generator().manual_seed(len(name))) + 0.5
        if quantized and is_stored_fp8(name):
            store_block_fp8(name, w, tensors, meaning)
        else:
            tensors[name] = meaning[name] = w
    save_file(tensors, str(path / "model.safetensors"))
    quantization = {"quantization_config": BLOCK_FP8} if quantized else {}
    (path / "config.json").write_text(json.dumps({**hf_config, **quantization}))
    return meaning
