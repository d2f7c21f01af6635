"""The sparse mixture-of-experts block that replaces a decoder layer's MLP (Qwen2/3-MoE, Mixtral).

    y = sum_j w_j * expert_{e_j}(x)   (+ sigmoid(x . g) * shared_expert(x), where the family has one)

Routing, expert compute and combine are separate functions (engine/layers/moe_ops.py) over expert
weights stacked per projection, `w13 [E, 2I, H]` and `w2 [E, H, I]`, loaded from the checkpoint's
per-expert tensors. Family differences are `MoeConfig` fields (engine/moe_config.py).

Tensor parallelism shards every expert's intermediate features like a dense MLP's (each rank holds
`I / tp` of each expert; the router and the routing are replicated), so the block costs one
all-reduce, after the combine, plus the shared expert's own.

Expert parallelism gives each rank `E / ep` whole experts (`w13 [E/ep, 2I, H]`); tokens travel to
their experts' ranks and back by all-to-all (engine/parallel/expert.py), and the block ends with an
all-gather of the ranks' token slices instead of the all-reduce.

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
from engine.layers.linear import Linear, copy_checked
from engine.layers.mlp import SwiGLUMLP
from engine.layers.moe_ops import ExpertRouting, combine_expert_outputs, expert_outputs, route_tokens
from engine.moe_config import MoeConfig, moe_block_hf_shapes
from engine.parallel.expert import ExpertParallel, dispatch_compute_combine, gather_token_slices
from engine.parallel.group import TensorParallel

_EXPERT_NAME = re.compile(r"^experts\.(\d+)\.(\w+)\.weight$")


class StackedExperts(nn.Module):
    """This rank's SwiGLU experts as two tensors: `w13 [E/ep, 2I/tp, H]` (gate rows, then up rows) and
    `w2 [E/ep, H, I/tp]`; local expert i is global expert `owned[i]`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.shard_start, self.shard_size = tp.shard(intermediate_size, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        self.owned = tp.expert.expert_range(num_experts)
        self.w13 = nn.Parameter(torch.empty(len(self.owned), 2 * self.shard_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(len(self.owned), hidden_size, self.shard_size))

    def load(self, expert: int, projection: int, tensor: torch.Tensor) -> None:
        """`projection`: 0 gate, 1 up (rows of w13), 2 down (columns of w2); this rank's slice only
        (another expert-parallel rank's expert is skipped)."""
        if expert not in self.owned:
            return
        full, start, size = self.intermediate_size, self.shard_start, self.shard_size
        expected = (self.w2.shape[1], full) if projection == 2 else (full, self.w13.shape[2])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"expert {expert}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        local = expert - self.owned.start
        if projection == 2:
            dst, src = self.w2.data[local], tensor.narrow(1, start, size)
        else:
            dst, src = self.w13.data[local].narrow(0, projection * size, size), tensor.narrow(0, start, size)
        copy_checked(dst, src, f"expert {expert}")

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """`[T, H], [T, k] -> [T, k, H]`, unweighted (this rank's partial sums under tensor parallelism);
        `expert_ids` are local ids (global ones when this rank holds every expert)."""
        return expert_outputs(x, expert_ids, self.w13, self.w2)


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
        self._projections = {names.gate: 0, names.up: 1, names.down: 2}
        self.register_buffer("expert_tokens", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = route_tokens(self.gate(x), self.moe.top_k, self.moe.renormalize)
        flat_ids = routing.expert_ids.reshape(-1)
        self.expert_tokens.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # no host sync: graph-safe
        if self.ep.size > 1:
            return self._expert_parallel_forward(x, routing)
        out = self.tp.all_reduce(combine_expert_outputs(self.experts(x, routing.expert_ids), routing.weights))
        return self._add_shared_expert(x, out)

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

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Load one checkpoint tensor named relative to the block (one of `hf_names()`)."""
        if name not in self.shapes:
            raise ModelLoadError(f"unexpected MoE weight {name!r}")
        expert = _EXPERT_NAME.match(name)
        shared = self.moe.names.shared_expert
        if expert is not None:
            self.experts.load(int(expert.group(1)), self._projections[expert.group(2)], tensor)
        elif name.startswith(f"{shared}.") and self.shared_expert is not None:
            self.shared_expert.load(name.split(".")[1], tensor)
        elif name == "gate.weight":
            copy_checked(self.gate.weight.data, tensor, name)
        elif self.shared_expert_gate is not None:
            copy_checked(self.shared_expert_gate.weight.data, tensor, name)


def expert_load_imbalance(counts: torch.Tensor) -> float:
    """`[layers, E]` token counts -> the worst layer's most loaded expert over its mean expert (1.0: even);
    layers that routed nothing are skipped."""
    busy = counts[counts.sum(dim=1) > 0].double()
    if busy.shape[0] == 0:
        return 1.0
    return float((busy.max(dim=1).values / busy.mean(dim=1)).max())
