"""Linear layers that load from Hugging Face's per-projection weights, optionally tensor-parallel.

Megatron's split of a transformer block, which needs one all-reduce per block half:
- `ColumnParallelLinear` splits output features across ranks. It also stacks several HF projections
  that read the same input (q/k/v, gate/up) into one matmul; each HF tensor's rows for this rank
  land in their own row range through `load_shard`. Its output stays sharded (each rank's heads, or
  its slice of the MLP's intermediate features).
- `RowParallelLinear` splits input features (o_proj, down_proj): each rank multiplies its slice and
  the partial products are summed by an all-reduce; the bias is added once, after the sum.
With `TensorParallel()` (size 1) both are plain linears and load HF tensors unsliced.

FP8: `use_fp8` turns a built layer's weight into e4m3 storage with dequantization scales
(engine/quant/); loading then accepts stored e4m3 tensors with their `weight_scale`/`weight_scale_inv`, or
quantizes float tensors on the way in, and `check_loaded` says whether every slice got its scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.parallel.group import TensorParallel
from engine.quant.config import BLOCK, Fp8Config, WeightScaling
from engine.quant.fp8 import FP8_DTYPE, dequantize_weight, fp8_linear
from engine.quant.fp8_load import (
    INPUT_SCALE,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
    load_block_scale,
    load_fp8_weight,
    load_per_row_scale,
)


class Linear(nn.Module):
    """`y = x W^T + b` with uninitialised parameters (weights always come from the checkpoint)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.fp8: Fp8Config | None = None
        # FP8 only: a buffer (not a parameter) so `.to(dtype)` leaves it float32 and loading does not expect it
        self.weight_scale: torch.Tensor | None
        self.register_buffer("weight_scale", None)
        # FP8 loading bookkeeping: which slices (shard indices) got their e4m3 weight and their scale.
        self._fp8_weights: set[int] = set()
        self._fp8_scales: set[int] = set()
        self._dequantized: torch.Tensor | None = None  # CPU reference only: float32 copy of the FP8 weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
        if x.is_cuda:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        if self._dequantized is None:  # the CPU reference: convert the e4m3 weight once, not every step
            self._dequantized = dequantize_weight(self.weight, self.weight_scale)
        return fp8_linear(x, self.weight, self.weight_scale, bias, self._dequantized)

    def use_fp8(self, config: Fp8Config) -> None:
        """Replace the weight by uninitialised e4m3 storage and its float32 scales (before loading)."""
        out, inp = self.weight.shape
        device = self.weight.device
        self.fp8 = config
        self.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8_DTYPE, device=device), requires_grad=False)
        shape = (out,) if config.scaling is WeightScaling.PER_ROW else (-(-out // BLOCK), -(-inp // BLOCK))
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))

    def load_replicated(self, kind: str, tensor: torch.Tensor) -> None:
        """A layer every rank holds whole: its checkpoint `weight` or `bias`, or (FP8) a scale kind."""
        if self.fp8 is not None and kind != "bias":
            out, inp = self.weight.shape
            if kind == "weight" and tuple(tensor.shape) != (out, inp):
                raise ModelLoadError(f"weight: checkpoint shape {tuple(tensor.shape)} != expected {(out, inp)}")
            self._load_fp8(kind, 0, tensor, 0, (0, out), (0, inp))
            return
        param = self.weight if kind == "weight" else self.bias
        if param is None or kind not in ("weight", "bias"):
            raise ModelLoadError(f"checkpoint tensor {kind!r} for a layer built without it (unquantized, no bias)")
        copy_checked(param.data, tensor, kind)

    def check_loaded(self, what: str) -> None:
        """FP8: every slice whose weight came stored in e4m3 must also have had its scale loaded."""
        if self.fp8 is None:
            return
        missing = sorted(self._fp8_weights - self._fp8_scales)
        if missing:
            raise ModelLoadError(f"{what}: FP8 weight of slice(s) {missing} has no weight_scale in the checkpoint")

    def _load_fp8(self, kind: str, index: int, tensor: torch.Tensor, row0: int,
                  src_rows: tuple[int, int], src_cols: tuple[int, int]) -> None:
        """One checkpoint tensor of slice `index`: rows `src_rows`, columns `src_cols` (start, count) of it
        land at weight row `row0` (column 0) of this layer."""
        assert self.fp8 is not None and self.weight_scale is not None
        self._dequantized = None
        if kind == INPUT_SCALE:
            return  # static activation scale: activations are scaled per token at run time instead
        if kind == "weight":
            part = tensor.narrow(0, *src_rows).narrow(1, *src_cols)
            quantized_here = load_fp8_weight(self.weight.data, self.weight_scale, self.fp8.scaling, row0, part)
            (self._fp8_scales if quantized_here else self._fp8_weights).add(index)
            return
        if self.fp8.scaling is WeightScaling.PER_ROW and kind == WEIGHT_SCALE:
            load_per_row_scale(self.weight_scale, row0, src_rows, tensor)
        elif self.fp8.scaling is WeightScaling.BLOCK_128 and kind == WEIGHT_SCALE_INV:
            load_block_scale(self.weight_scale, (row0, src_rows[1]), src_rows, src_cols, tensor)
        else:
            raise ModelLoadError(f"checkpoint tensor {kind!r} does not match the {self.fp8.scaling.value} FP8 scaling")
        self._fp8_scales.add(index)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        fp8 = f", fp8={self.fp8.scaling.value}" if self.fp8 is not None else ""
        return f"in={inp}, out={out}, bias={self.bias is not None}{fp8}"


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
        """Copy this rank's rows of the HF tensor of projection `index` (`kind`: "weight"/"bias", or an
        FP8 scale kind for an FP8 layer)."""
        shard = self.shards[index]
        if self.fp8 is not None and kind != "bias":
            if kind == "weight" and tensor.shape[0] != shard.full_size:
                raise ModelLoadError(f"shard {index} weight: checkpoint has {tensor.shape[0]} rows, expected "
                                     f"{shard.full_size}")
            cols = (0, self.weight.shape[1])
            self._load_fp8(kind, index, tensor, self.offsets[index], (shard.start, shard.size), cols)
            return
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise ModelLoadError(f"checkpoint has a bias for a projection built without one (shard {index})")
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
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's input columns of the HF weight (the bias is whole on every rank)."""
        if kind == "bias":
            assert self.bias is not None, "load() called for a bias the layer was built without"
            copy_checked(self.bias.data, tensor, "bias")
            return
        if self.fp8 is not None:
            rows = (0, self.weight.shape[0])
            if kind == "weight" and tuple(tensor.shape) != (self.weight.shape[0], self.full_input_size):
                raise ModelLoadError(f"weight: checkpoint shape {tuple(tensor.shape)} != expected "
                                     f"{(self.weight.shape[0], self.full_input_size)}")
            self._load_fp8(kind, 0, tensor, 0, rows, (self.input_start, self.weight.shape[1]))
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
