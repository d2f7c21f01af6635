"""The SwiGLU MLP (`down(silu(gate(x)) * up(x))`): every dense layer's MLP, and MoE shared experts."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.linear import ColumnParallelLinear, OutputShard, RowParallelLinear
from engine.parallel.group import TensorParallel


class SwiGLUMLP(nn.Module):
    """Megatron-sharded: each rank holds `intermediate_size / tp` features; one all-reduce after down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        shard = OutputShard.even(intermediate_size, tp, "intermediate_size")
        # Both halves sharded alike, so this rank's [gate | up] output is what SiluAndMul expects.
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [shard, shard], bias=False)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def load(self, projection: str, tensor: torch.Tensor) -> None:
        """Load HF's `gate_proj`, `up_proj` or `down_proj` weight (this rank's slice of it)."""
        if projection == "down_proj":
            self.down_proj.load("weight", tensor)
        else:
            self.gate_up_proj.load_shard(("gate_proj", "up_proj").index(projection), "weight", tensor)
