"""The SwiGLU MLP (`down(silu(gate(x)) * up(x))`): every dense layer's MLP, and MoE shared experts."""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.activation import SiluAndMul
from engine.layers.linear import ColumnParallelLinear, OutputShard, RowParallelLinear
from engine.parallel.group import TensorParallel
from engine.quant.config import Fp8Config


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

    def use_fp8(self, config: Fp8Config) -> None:
        """Hold both projections in FP8 (before loading)."""
        self.gate_up_proj.use_fp8(config)
        self.down_proj.use_fp8(config)

    def load(self, projection: str, tensor: torch.Tensor, kind: str = "weight") -> None:
        """Load HF's `gate_proj`, `up_proj` or `down_proj` weight, or (FP8 projections) one of its scales
        (this rank's slice of it)."""
        linear = self.down_proj if projection == "down_proj" else self.gate_up_proj
        if kind != "weight" and linear.fp8 is None:  # unquantized, or left so by the checkpoint's ignore list
            raise ModelLoadError(f"{projection}: FP8 tensor {kind!r} for a projection built unquantized")
        if projection == "down_proj":
            self.down_proj.load(kind, tensor)
        else:
            self.gate_up_proj.load_shard(("gate_proj", "up_proj").index(projection), kind, tensor)
