"""Linear layers that load from Hugging Face's per-projection weights.

`MergedLinear` stacks several HF projections that read the same input (q/k/v, gate/up) into one
matmul; each HF tensor is copied into its own row range by `load_shard`. Tensor parallelism will
replace these with column-parallel (merged) and row-parallel (`Linear`) versions that keep the same
`load_shard` / `load` entry points, so the model's loading code stays as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError


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


class MergedLinear(Linear):
    """Several projections of one input as one matmul; output is `[..., sum(output_sizes)]`."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = tuple(output_sizes)
        self.offsets = tuple(sum(output_sizes[:i]) for i in range(len(output_sizes)))

    def load_shard(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """Copy the HF tensor of projection `index` (`kind` is "weight" or "bias") into its rows."""
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ModelLoadError(f"checkpoint has a bias for a projection built without one (shard {index})")
        rows = param.data.narrow(0, self.offsets[index], self.output_sizes[index])
        copy_checked(rows, tensor, f"shard {index} {kind}")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter, converting dtype; shapes must match exactly."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
