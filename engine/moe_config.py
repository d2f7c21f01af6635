"""What a mixture-of-experts family is, as data: routing, experts, shared expert, weight names.

The MoE block (engine/layers/moe.py) has no per-family code: Qwen2-MoE, Qwen3-MoE and Mixtral differ
only in the fields below, read from a Hugging Face config.json by `moe_config_from_hf`.

- Routing: softmax over all experts' logits, keep the top k; `renormalize` rescales the kept k to
  sum to one. Mixtral always does (HF: softmax over the top-k logits, the same thing); Qwen reads
  `norm_topk_prob` (Qwen3-MoE releases set it, Qwen1.5/2-MoE do not).
- Shared expert (Qwen2-MoE; DeepSeek's `shared_experts` have the same shape): a dense MLP every token
  goes through beside its routed experts, optionally scaled by `sigmoid(x . shared_expert_gate)`.
- Sparse layers: Qwen's `decoder_sparse_step` / `mlp_only_layers` leave some layers dense; DeepSeek's
  `first_k_dense_replace` / `moe_layer_freq` likewise.
- DeepSeek-V2/V3 route through `GroupedRouting`: experts are split into groups, each token first keeps
  its best `topk_groups` groups, then its top k experts among them; scores are a softmax (V2) or
  sigmoids plus a per-expert bias that steers the choice but not the weights (V3), and the kept
  weights are scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine.errors import ConfigError
from engine.mla_config import MLA_ARCHITECTURES

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", *MLA_ARCHITECTURES)


@dataclass(frozen=True)
class ExpertWeightNames:
    """How a family's checkpoint names its MoE block: `model.layers.{i}.{block}.experts.{e}.{gate}.weight`."""

    block: str  # the decoder layer's MLP attribute: "mlp" (Qwen) or "block_sparse_moe" (Mixtral)
    gate: str  # the expert's gate projection (SiLU input)
    up: str
    down: str
    shared_expert: str = "shared_expert"  # Qwen2-MoE's dense shared MLP (its projections: gate/up/down_proj)


QWEN_EXPERT_NAMES = ExpertWeightNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
MIXTRAL_EXPERT_NAMES = ExpertWeightNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
DEEPSEEK_EXPERT_NAMES = ExpertWeightNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj",
                                          shared_expert="shared_experts")


class RouterScoring(Enum):
    SOFTMAX = "softmax"  # over every expert's logit (DeepSeek-V2)
    SIGMOID = "sigmoid"  # each expert's logit on its own (DeepSeek-V3)


class GroupScore(Enum):
    """How a group of experts is ranked when choosing a token's groups."""

    MAX = "max"  # its best expert's score (V2's group_limited_greedy)
    TOP2_SUM = "top2_sum"  # the sum of its two best biased scores (V3)


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's group-limited top-k (module docstring); one group of every expert is plain top-k."""

    scoring: RouterScoring
    num_groups: int = 1
    topk_groups: int = 1
    group_score: GroupScore = GroupScore.MAX
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # V3's `gate.e_score_correction_bias [E]`, added for the choice only

    def __post_init__(self) -> None:
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"need 1 <= topk_groups <= n_group, got {self.topk_groups}, {self.num_groups}")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's MLP width
    renormalize: bool  # rescale the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...]  # layers whose MLP is the MoE block
    names: ExpertWeightNames = QWEN_EXPERT_NAMES
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # the shared expert's output is scaled by sigmoid(x . gate)
    grouped: GroupedRouting | None = None  # None: softmax top-k (Qwen, Mixtral)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MoE {name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoE top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.shared_expert_intermediate_size < 0:
            raise ConfigError(
                f"shared_expert_intermediate_size must be >= 0, got {self.shared_expert_intermediate_size}")
        if self.shared_expert_gated and not self.shared_expert_intermediate_size:
            raise ConfigError("shared_expert_gated needs a shared expert (shared_expert_intermediate_size > 0)")
        if self.grouped is not None and self.num_experts % self.grouped.num_groups:
            raise ConfigError(f"num_experts ({self.num_experts}) must be a multiple of n_group "
                              f"({self.grouped.num_groups})")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


def moe_config_from_hf(arch: str, hf: dict[str, Any]) -> MoeConfig | None:
    """The MoE part of a HF config.json dict; None for dense architectures."""
    if arch not in MOE_ARCHITECTURES:
        return None
    num_layers = hf["num_hidden_layers"]
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (an attribute alias).
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
    if not num_experts:
        raise ConfigError(f"{arch} config has no num_experts / num_local_experts")
    if arch in MLA_ARCHITECTURES:
        return _deepseek_moe_config(arch, hf, num_experts)
    if arch == "MixtralForCausalLM":
        return MoeConfig(num_experts=num_experts, top_k=hf.get("num_experts_per_tok", 2),
                         intermediate_size=hf["intermediate_size"], renormalize=True,
                         sparse_layers=tuple(range(num_layers)), names=MIXTRAL_EXPERT_NAMES)
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    shared = hf.get("shared_expert_intermediate_size") or 0
    return MoeConfig(
        num_experts=num_experts,
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        shared_expert_intermediate_size=shared,
        shared_expert_gated=bool(shared),  # Qwen2-MoE's shared expert always has its sigmoid gate
    )


def _deepseek_moe_config(arch: str, hf: dict[str, Any], num_experts: int) -> MoeConfig:
    """DeepSeek-V2/V3: `first_k_dense_replace` dense layers, then every `moe_layer_freq`-th layer sparse."""
    first_dense, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    v3 = arch == "DeepseekV3ForCausalLM"
    renormalize = bool(hf.get("norm_topk_prob", v3))
    grouped_topk = v3 or hf.get("topk_method") == "group_limited_greedy"
    scaling = float(hf.get("routed_scaling_factor") or 1.0)
    routing = GroupedRouting(
        scoring=RouterScoring.SIGMOID if v3 else RouterScoring.SOFTMAX,
        num_groups=(hf.get("n_group") or 1) if grouped_topk else 1,
        topk_groups=(hf.get("topk_group") or 1) if grouped_topk else 1,
        group_score=GroupScore.TOP2_SUM if v3 else GroupScore.MAX,
        # DeepSeek-V2's own code scales only weights it did not renormalise (V3 does both).
        routed_scaling_factor=1.0 if renormalize and not v3 else scaling,
        score_correction_bias=v3,
    )
    moe_size = hf["moe_intermediate_size"]
    return MoeConfig(
        num_experts=num_experts, top_k=hf["num_experts_per_tok"], intermediate_size=moe_size,
        renormalize=renormalize,
        sparse_layers=tuple(i for i in range(hf["num_hidden_layers"]) if i >= first_dense and i % freq == 0),
        names=DEEPSEEK_EXPERT_NAMES, shared_expert_intermediate_size=moe_size * (hf.get("n_shared_experts") or 0),
        grouped=routing,
    )


def moe_block_hf_shapes(moe: MoeConfig, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of one MoE block as the checkpoint names it, relative to `model.layers.{i}.{block}.`."""
    names, inter = moe.names, moe.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"gate.weight": (moe.num_experts, hidden_size)}
    # Projection-major (every expert's gate, then every up, then every down): GGUF stacks each
    # projection's experts in one tensor, which is then dequantized once and read in this order.
    for projection, shape in ((names.gate, (inter, hidden_size)), (names.up, (inter, hidden_size)),
                              (names.down, (hidden_size, inter))):
        for e in range(moe.num_experts):
            shapes[f"experts.{e}.{projection}.weight"] = shape
    if moe.has_shared_expert:
        shared, size = names.shared_expert, moe.shared_expert_intermediate_size
        shapes[f"{shared}.gate_proj.weight"] = (size, hidden_size)
        shapes[f"{shared}.up_proj.weight"] = (size, hidden_size)
        shapes[f"{shared}.down_proj.weight"] = (hidden_size, size)
    if moe.shared_expert_gated:
        shapes[f"{names.shared_expert}_gate.weight"] = (1, hidden_size)
    if moe.grouped is not None and moe.grouped.score_correction_bias:
        shapes["gate.e_score_correction_bias"] = (moe.num_experts,)
    return shapes
