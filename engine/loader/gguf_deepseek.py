"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2` architecture, used for both) in Hugging Face terms.

What llama.cpp's converter does differently from the other families:
- `kv_b_proj` is stored split for its absorbed MLA: `attn_k_b` (W_UK transposed, `[H, kv_lora_rank,
  qk_nope]`) and `attn_v_b` (W_UV, `[H, v_head_dim, kv_lora_rank]`); older files hold `attn_kv_b` whole.
  `kv_b_from_split` rebuilds the HF tensor.
- The heads' dims are metadata of their own (`attention.key_length_mla`, `value_length_mla`,
  `rope.dimension_count`, `attention.kv_lora_rank`, `attention.q_lora_rank`); `head_count_kv` is 1
  in new files (the latent), so the HF config's KV heads are the query heads.
- V3 is told from V2 by its gating function (sigmoid) and its routing bias (`exp_probs_b`).
- Yarn: the file keeps `yarn_log_multiplier = 0.1 * mscale_all_dim`, not `mscale`; every DeepSeek
  release has `mscale == mscale_all_dim`, which is what is assumed.
Rotary rows are stored as in the HF checkpoint (no q/k permutation), DeepSeek's interleaved layout.
"""

from __future__ import annotations

from typing import Any, Protocol

import gguf
import torch

from engine.errors import ModelLoadError

DEEPSEEK_GGUF_ARCH = "deepseek2"


class GGUFKeys(Protocol):
    """The metadata reads of a GGUF file that DeepSeek's translation makes (engine/loader/gguf_file.py)."""

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, or `default`."""
        ...

    def require(self, key: str) -> Any:
        """`<arch>.<key>`; ModelLoadError when the file lacks it."""
        ...


def deepseek_hf_config(gfile: GGUFKeys, base: dict[str, Any]) -> dict[str, Any]:
    """`base` (the generic translation) with DeepSeek's MLA, routing and yarn keys."""
    sigmoid = int(gfile.arch_get("expert_gating_func", 1)) == gguf.ExpertGatingFuncType.SIGMOID.value
    groups = int(gfile.arch_get("expert_group_count", 1) or 1)
    rope_dim = int(gfile.require("rope.dimension_count"))
    config = {
        **base,
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "num_key_value_heads": base["num_attention_heads"],
        "kv_lora_rank": int(gfile.require("attention.kv_lora_rank")),
        "q_lora_rank": int(gfile.arch_get("attention.q_lora_rank", 0)) or None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": int(gfile.require("attention.key_length_mla")) - rope_dim,
        "v_head_dim": int(gfile.require("attention.value_length_mla")),
        "n_routed_experts": int(gfile.require("expert_count")),
        "num_experts_per_tok": int(gfile.require("expert_used_count")),
        "moe_intermediate_size": int(gfile.require("expert_feed_forward_length")),
        "n_shared_experts": int(gfile.arch_get("expert_shared_count", 0)),
        "first_k_dense_replace": int(gfile.arch_get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(gfile.arch_get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(gfile.arch_get("expert_weights_norm", sigmoid)),
        "n_group": groups,
        "topk_group": int(gfile.arch_get("expert_group_used_count", 1) or 1),
        "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
    }
    for key in ("num_experts", "shared_expert_intermediate_size", "head_dim"):
        config.pop(key, None)
    if str(gfile.arch_get("rope.scaling.type", "")) == "yarn":
        mscale = float(gfile.arch_get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        config["rope_scaling"] = config["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": base["rope_theta"],
            "factor": float(gfile.require("rope.scaling.factor")),
            "original_max_position_embeddings": int(gfile.require("rope.scaling.original_context_length")),
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}
    return config


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's `kv_b_proj.weight [H * (nope + v), C]` from `k_b [H, C, nope]` and `v_b [H, v, C]`."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ModelLoadError(f"GGUF attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not pair up")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()
