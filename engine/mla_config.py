"""What DeepSeek's multi-head latent attention (MLA) is, as data: ranks, head dims, softmax scale.

MLA (DeepSeek-V2/V3) compresses every token's keys and values into one latent vector of
`kv_lora_rank` features plus one shared rotary key of `qk_rope_head_dim`; per head,

    k_h = [W_UK_h c ; k_rope]     v_h = W_UV_h c      (c: the RMS-normed latent, W_UK/W_UV: kv_b_proj)

so the paged cache stores only `c` and `k_rope` per token (engine/layers/mla.py says how attention
runs over them). Queries come from `q_proj`, or from the low-rank pair `q_a_proj -> q_a_layernorm ->
q_b_proj` when `q_lora_rank` is set (V2, V3; V2-Lite has none).

DeepSeek's rotary layout pairs adjacent features `(x0, x1), (x2, x3), ...` (`rope_interleaved`;
transformers' V3 `rope_interleave=False` uses Llama's rotate-half instead). The engine rotates with
rotate-half only: interleaved checkpoints have the rotary rows of `q_b_proj`/`q_proj` and
`kv_a_proj_with_mqa` permuted at load (evens first, then odds), which turns one convention into the
other. Only q.k products see those features, and q and k are permuted alike, so scores are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int  # latent features cached per token
    qk_nope_head_dim: int  # per-head query/key features without position (from the latent)
    qk_rope_head_dim: int  # per-head query features with RoPE; the key's are shared by every head
    v_head_dim: int
    softmax_scale: float  # qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2
    q_lora_rank: int | None = None  # None: queries from one q_proj
    rope_interleaved: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MLA {name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLA qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"MLA q_lora_rank must be positive or None, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Features cached per token and layer: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude correction `0.1 * mscale * ln(factor) + 1` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_config_from_hf(arch: str, hf: dict[str, Any], rope: dict[str, Any]) -> MlaConfig | None:
    """The MLA part of a HF config.json dict (`rope`: its rope_scaling / rope_parameters); None otherwise."""
    if arch not in MLA_ARCHITECTURES:
        return None
    nope, rope_dim = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    scale = (nope + rope_dim) ** -0.5
    if (rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return MlaConfig(
        kv_lora_rank=hf.get("kv_lora_rank", 512), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=hf.get("v_head_dim", 128), softmax_scale=scale, q_lora_rank=hf.get("q_lora_rank"),
        rope_interleaved=arch == "DeepseekV2ForCausalLM" or bool(hf.get("rope_interleave", True)),
    )


def mla_hf_shapes(mla: MlaConfig, hidden_size: int, num_heads: int) -> dict[str, tuple[int, ...]]:
    """Every attention tensor of one layer as the checkpoint names it, relative to `model.layers.{i}.self_attn.`."""
    q_out = num_heads * mla.qk_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if mla.q_lora_rank is None:
        shapes["q_proj.weight"] = (q_out, hidden_size)
    else:
        shapes["q_a_proj.weight"] = (mla.q_lora_rank, hidden_size)
        shapes["q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes["q_b_proj.weight"] = (q_out, mla.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (mla.latent_dim, hidden_size)
    shapes["kv_a_layernorm.weight"] = (mla.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    shapes["o_proj.weight"] = (hidden_size, num_heads * mla.v_head_dim)
    return shapes
