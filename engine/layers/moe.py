"""The sparse mixture-of-experts block that replaces a decoder layer's MLP (Qwen2/3-MoE, Mixtral).

    y = sum_j w_j * expert_{e_j}(x)   (+ sigmoid(x . g) * shared_expert(x), where the family has one)

Routing, expert compute and combine are separate functions (engine/layers/moe_ops.py) over expert
weights stacked per projection, `w13 [E, 2I, H]` and `w2 [E, H, I]`, loaded from the checkpoint's
per-expert tensors. Family differences are `MoeConfig` fields (engine/moe_config.py).

Tensor parallelism shards every expert's intermediate features like a dense MLP's (each rank holds
`I / tp` of each expert, engine/layers/stacked_experts.py; the router and the routing are replicated),
so the block costs one all-reduce, after the combine, plus the shared expert's own.

Expert parallelism gives each rank `E / ep` whole experts (`w13 [E/ep, 2I, H]`); tokens travel to
their experts' ranks and back by all-to-all (engine/parallel/expert.py), and the block ends with an
all-gather of the ranks' token slices instead of the all-reduce.

FP8 (`use_fp8`: an FP8 checkpoint, Qwen3-FP8's or DeepSeek-V3's 128 x 128 block scales or
compressed-tensors per-channel, or online `--quantization fp8`): the routed experts stay e4m3 with their
scales (engine/layers/stacked_experts.py; the fused kernel reads them, engine/kernels/fused_moe.py) and
the shared expert's projections are FP8 linears. The router and the shared expert's gate (kept
unquantized by those checkpoints; a few KB) stay in the activation dtype: if a checkpoint does store
them in FP8, they are dequantized as they load (engine/layers/fp8_dequant.py).

`expert_tokens [E]` counts the (token, slot) pairs routed to each expert, for the worker's load
metric. Every rank routes every token, so rank 0's counts are the whole batch's. Padding rows of a
CUDA-graph decode batch are counted too (the graph cannot see how many rows are real).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.layers.fp8_dequant import Fp8Dequantizer
from engine.layers.linear import Linear, copy_checked
from engine.layers.mlp import SwiGLUMLP
from engine.layers.moe_ops import (
    ExpertRouting,
    combine_expert_outputs,
    route_tokens,
    route_tokens_grouped,
)
from engine.layers.stacked_experts import DOWN, GATE, UP, StackedExperts
from engine.moe_config import MoeConfig, moe_block_hf_shapes
from engine.parallel.expert import ExpertParallel, dispatch_compute_combine, gather_token_slices
from engine.parallel.group import TensorParallel
from engine.quant.config import Fp8Config

_EXPERT_NAME = re.compile(r"^experts\.(\d+)\.(\w+)$")  # a checkpoint name's base (before `.weight`)


class SparseMoeBlock(nn.Module):
    expert_tokens: torch.Tensor  # [E] int64 buffer: token slots routed to each expert (module docstring)

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        assert config.moe is not None, "SparseMoeBlock built for a dense model"
        moe: MoeConfig = config.moe
        self.moe = moe
        self.tp = tp
        self.ep: ExpertParallel = tp.expert
        self.shapes = moe_block_hf_shapes(moe, config.hidden_size)
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)  # the router, replicated
        self.experts = StackedExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, tp)
        self.shared_expert = (SwiGLUMLP(config.hidden_size, moe.shared_expert_intermediate_size, tp)
                              if moe.has_shared_expert else None)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if moe.shared_expert_gated else None
        names = moe.names
        self._projections = {names.gate: GATE, names.up: UP, names.down: DOWN}
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        # DeepSeek-V3's `gate.e_score_correction_bias`: steers which experts are chosen, not their weights.
        has_bias = moe.grouped is not None and moe.grouped.score_correction_bias
        self.score_bias = nn.Parameter(torch.empty(moe.num_experts)) if has_bias else None
        self.fp8 = Fp8Dequantizer()  # FP8 router / shared-expert gate halves waiting for each other

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = self._route(x)
        flat_ids = routing.expert_ids.reshape(-1)
        self.expert_tokens.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # no host sync: graph-safe
        if self.ep.size > 1:
            return self._expert_parallel_forward(x, routing)
        out = self.tp.all_reduce(combine_expert_outputs(self.experts(x, routing.expert_ids), routing.weights))
        return self._add_shared_expert(x, out)

    def _route(self, x: torch.Tensor) -> ExpertRouting:
        logits = self.gate(x)
        if self.moe.grouped is None:
            return route_tokens(logits, self.moe.top_k, self.moe.renormalize)
        return route_tokens_grouped(logits, self.moe.top_k, self.moe.renormalize, self.moe.grouped, self.score_bias)

    def _expert_parallel_forward(self, x: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
        """This rank's token slice through the all-to-all, then every slice to every rank."""
        start, end = self.ep.token_slice(x.shape[0])
        part = x[start:end]
        outputs = dispatch_compute_combine(self.ep, part, routing.expert_ids[start:end], self.moe.num_experts,
                                           self.experts)
        out = self._add_shared_expert(part, combine_expert_outputs(outputs, routing.weights[start:end]))
        return gather_token_slices(self.ep, out, x.shape[0])

    def _add_shared_expert(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def hf_names(self) -> set[str]:
        """The checkpoint's names of this block's tensors, relative to `model.layers.{i}.{block}.`."""
        return set(self.shapes)

    def use_fp8(self, config: Fp8Config) -> None:
        """Hold the routed experts and the shared expert in FP8 (before loading; see the module docstring)."""
        self.experts.use_fp8(config)
        if self.shared_expert is not None:
            self.shared_expert.use_fp8(config)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Load one checkpoint tensor named relative to the block: one of `hf_names()`, or an FP8 weight's
        scale (`weight_scale`, `weight_scale_inv`, `input_scale`)."""
        base, kind = name.rsplit(".", 1)
        fp8_part = Fp8Dequantizer.wants(kind, tensor)
        if name not in self.shapes and not (fp8_part and f"{base}.weight" in self.shapes):
            raise ModelLoadError(f"unexpected MoE weight {name!r}")
        expert = _EXPERT_NAME.match(base)
        shared = self.moe.names.shared_expert
        if expert is not None:
            self.experts.load(int(expert.group(1)), self._projections[expert.group(2)], tensor, kind)
        elif base.startswith(f"{shared}.") and self.shared_expert is not None:
            self.shared_expert.load(base.split(".")[1], tensor, kind)
        elif fp8_part:  # the router or the shared expert's gate stored in FP8: loads dequantized, once paired
            dequantized = self.fp8.take(base, kind, tensor)
            if dequantized is not None:
                self._load_small(f"{base}.weight", dequantized)
        else:
            self._load_small(name, tensor)

    def _load_small(self, name: str, tensor: torch.Tensor) -> None:
        """The router, its correction bias or the shared expert's gate (replicated, activation dtype)."""
        if name == "gate.weight":
            copy_checked(self.gate.weight.data, tensor, name)
        elif name == "gate.e_score_correction_bias" and self.score_bias is not None:
            copy_checked(self.score_bias.data, tensor, name)
        elif self.shared_expert_gate is not None:
            copy_checked(self.shared_expert_gate.weight.data, tensor, name)

    def check_loaded(self, prefix: str) -> None:
        """Raise if an FP8 weight's scale (or a scale's weight) never came."""
        self.fp8.check_complete(prefix)
        self.experts.check_loaded(prefix)


def expert_load_imbalance(counts: torch.Tensor) -> float:
    """`[layers, E]` token counts -> the worst layer's most loaded expert over its mean expert (1.0: even);
    layers that routed nothing are skipped."""
    busy = counts[counts.sum(dim=1) > 0].double()
    if busy.shape[0] == 0:
        return 1.0
    return float((busy.max(dim=1).values / busy.mean(dim=1)).max())
