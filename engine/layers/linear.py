"""Linear layers that load from Hugging Face's per-projection weights, optionally tensor-parallel.

Megatron's split of a transformer block, which needs one all-reduce per block half:
- `ColumnParallelLinear` splits output features across ranks. It also stacks several HF projections
  that read the same input (q/k/v, gate/up) into one matmul; each HF tensor's rows for this rank
  land in their own row range through `load_shard`. Its output stays sharded (each rank's heads, or
  its slice of the MLP's intermediate features).
- `RowParallelLinear` splits input features (o_proj, down_proj): each rank multiplies its slice and
  the partial products are summed by an all-reduce; the bias is added once, after the sum.
With `TensorParallel()` (size 1) both are plain linears and load HF tensors unsliced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.parallel.group import TensorParallel


class Linear(nn.Module):
    """`y = x W^T + b` with uninitialised parameters (weights always come from the checkpoint)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, bias={self.bias is not None}"


@dataclass(frozen=True)
class OutputShard:
    """This rank's rows `[start, start + size)` of one HF projection of `full_size` output rows."""

    full_size: int
    start: int
    size: int

    @classmethod
    def even(cls, full_size: int, tp: TensorParallel, what: str) -> OutputShard:
        start, size = tp.shard(full_size, what)
        return cls(full_size, start, size)


class ColumnParallelLinear(Linear):
    """Several projections of one input as one matmul; output `[..., sum(shard sizes)]`, sharded."""

    def __init__(self, input_size: int, shards: Sequence[OutputShard], bias: bool) -> None:
        super().__init__(input_size, sum(s.size for s in shards), bias)
        self.shards = tuple(shards)
        self.offsets = tuple(sum(s.size for s in shards[:i]) for i in range(len(shards)))

    @property
    def output_sizes(self) -> tuple[int, ...]:
        """Per-projection widths of this rank's output (split the matmul's result with these)."""
        return tuple(s.size for s in self.shards)

    def load_shard(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the HF tensor of projection `index` (`kind`: "weight"/"bias")."""
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ModelLoadError(f"checkpoint has a bias for a projection built without one (shard {index})")
        shard = self.shards[index]
        expected = (shard.full_size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"shard {index} {kind}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        rows = param.data.narrow(0, self.offsets[index], shard.size)
        copy_checked(rows, tensor.narrow(0, shard.start, shard.size), f"shard {index} {kind}")


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial products are all-reduced, then the bias added."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallel) -> None:
        start, local = tp.shard(input_size, "row-parallel input features")
        super().__init__(local, output_size, bias)
        self.tp = tp
        self.input_start = start
        self.full_input_size = input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's input columns of the HF weight (the bias is whole on every rank)."""
        if kind == "bias":
            assert self.bias is not None, "load() called for a bias the layer was built without"
            copy_checked(self.bias.data, tensor, "bias")
            return
        expected = (self.weight.shape[0], self.full_input_size)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"weight: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        copy_checked(self.weight.data, tensor.narrow(1, self.input_start, self.weight.shape[1]), "weight")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter, converting dtype; shapes must match exactly."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
