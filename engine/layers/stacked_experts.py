"""A MoE block's routed experts as two stacked tensors, in the activation dtype or in FP8 (e4m3).

`w13 [E/ep, 2I/tp, H]` holds each expert's gate rows, then its up rows; `w2 [E/ep, H, I/tp]` its down
projection. Tensor parallelism shards every expert's intermediate features like a dense MLP's; expert
parallelism gives each rank whole experts (local expert i is global expert `owned[i]`), so each rank
holds, and loads, only its own experts' bytes.

FP8 (`use_fp8`, before loading): the stacks become e4m3 with float32 dequantization scales in the
fused MoE kernel's layouts (engine/kernels/fused_moe.py): per output row (`w13_scale [E, 2I]`,
`w2_scale [E, H]`), or per 128 x 128 block with the gate's and the up's blocks kept apart
(`w13_scale [E, 2 * ceil(I/128), ceil(H/128)]`, `w2_scale [E, ceil(H/128), ceil(I/128)]`), as a
checkpoint scales each projection on its own. Loading takes an FP8 checkpoint's e4m3 tensors and
their `weight_scale` / `weight_scale_inv` as stored (engine/quant/fp8_load.py), or quantizes float
tensors on the way in (online `--quantization fp8`, dummy weights); experts then take one byte per
weight in memory, half of bf16. Tensor parallelism over block scales must cut on 128-feature
boundaries (`I / tp` a multiple of 128), or loading raises `ModelLoadError`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.linear import copy_checked
from engine.layers.moe_ops import expert_outputs
from engine.parallel.group import TensorParallel
from engine.quant.config import BLOCK, Fp8Config, WeightScaling
from engine.quant.fp8 import FP8_DTYPE
from engine.quant.fp8_load import (
    INPUT_SCALE,
    WEIGHT_SCALE,
    WEIGHT_SCALE_INV,
    load_block_scale,
    load_fp8_weight,
    load_per_row_scale,
)

GATE, UP, DOWN = 0, 1, 2  # an expert's projections, as `load` numbers them


class StackedExperts(nn.Module):
    """This rank's SwiGLU experts (module docstring)."""

    w13_scale: torch.Tensor | None  # FP8 only: buffers, so `.to(dtype)` leaves them float32
    w2_scale: torch.Tensor | None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.shard_start, self.shard_size = tp.shard(intermediate_size, "moe_intermediate_size")
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.owned = tp.expert.expert_range(num_experts)
        # The stacks are made when first needed (`use_fp8`, or the first load), on the device the model is
        # built on: an FP8 model's experts, nearly all of an MoE's bytes, never exist in bf16, not even
        # between construction and `use_fp8` (a bf16 peak would defeat FP8 where it matters most).
        self.device = torch.get_default_device()
        self.w13 = nn.Parameter(torch.empty(len(self.owned), 2 * self.shard_size, hidden_size, device="meta"))
        self.w2 = nn.Parameter(torch.empty(len(self.owned), hidden_size, self.shard_size, device="meta"))
        self.fp8: Fp8Config | None = None
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        # FP8 loading bookkeeping, by (global expert, projection): e4m3 weights that came stored, and the
        # projections whose scale is known (loaded, or made when a float weight was quantized here).
        self._stored: set[tuple[int, int]] = set()
        self._scaled: set[tuple[int, int]] = set()

    def use_fp8(self, config: Fp8Config) -> None:
        """Replace the stacks by uninitialised e4m3 storage and their scales (before loading)."""
        experts, size, hidden = len(self.owned), self.shard_size, self.hidden_size
        device = self.device
        self.fp8 = config
        self.w13 = nn.Parameter(torch.empty(experts, 2 * size, hidden, dtype=FP8_DTYPE, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, size, dtype=FP8_DTYPE, device=device),
                               requires_grad=False)
        w13_scale: tuple[int, ...]
        w2_scale: tuple[int, ...]
        if config.scaling is WeightScaling.PER_ROW:
            w13_scale, w2_scale = (experts, 2 * size), (experts, hidden)
        else:
            w13_scale = (experts, 2 * _blocks(size), _blocks(hidden))
            w2_scale = (experts, _blocks(hidden), _blocks(size))
        self.register_buffer("w13_scale", torch.ones(w13_scale, dtype=torch.float32, device=device))
        self.register_buffer("w2_scale", torch.ones(w2_scale, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """`[T, H], [T, k] -> [T, k, H]`, unweighted (this rank's partial sums under tensor parallelism);
        `expert_ids` are local ids (global ones when this rank holds every expert)."""
        return expert_outputs(x, expert_ids, self.w13, self.w2, self.w13_scale, self.w2_scale)

    def load(self, expert: int, projection: int, tensor: torch.Tensor, kind: str = "weight") -> None:
        """One checkpoint tensor of global `expert`'s `projection` (GATE, UP, DOWN): its `weight`, or an FP8
        scale kind; this rank keeps its slice (another expert-parallel rank's expert is skipped)."""
        if expert not in self.owned:
            return
        full, hidden = self.intermediate_size, self.hidden_size
        expected = (hidden, full) if projection == DOWN else (full, hidden)
        if kind == "weight" and tuple(tensor.shape) != expected:
            raise ModelLoadError(f"expert {expert}: checkpoint shape {tuple(tensor.shape)} != expected {expected}")
        if self.fp8 is not None:
            self._load_fp8(expert, projection, kind, tensor)
            return
        if kind != "weight" or tensor.dtype == FP8_DTYPE:
            raise ModelLoadError(f"expert {expert}: FP8 tensor {kind!r} for experts built unquantized")
        self._materialize()
        dst, _ = self._destination(expert, projection)
        src_rows, cols = self._source_ranges(projection)
        copy_checked(dst, tensor.narrow(0, *src_rows).narrow(1, *cols), f"expert {expert}")

    def _materialize(self) -> None:
        """Allocate the unquantized stacks (in the dtype `.to(dtype)` gave them) before the first load."""
        if self.w13.is_meta:
            self.w13 = nn.Parameter(torch.empty_like(self.w13, device=self.device))
            self.w2 = nn.Parameter(torch.empty_like(self.w2, device=self.device))

    def check_loaded(self, what: str) -> None:
        """FP8: every expert projection whose weight came stored in e4m3 must also have had its scale."""
        missing = sorted(self._stored - self._scaled)
        if missing:
            expert, projection = missing[0]
            raise ModelLoadError(f"{what}experts.{expert} projection {projection}: FP8 weight without its scale "
                                 f"({len(missing)} expert projections unscaled)")

    def _load_fp8(self, expert: int, projection: int, kind: str, tensor: torch.Tensor) -> None:
        assert self.fp8 is not None
        if kind == INPUT_SCALE:
            return  # a static activation scale: the experts run unquantized activations (weight-only)
        weight, scale = self._destination(expert, projection)
        assert scale is not None, "use_fp8 made the scales"
        src_rows, cols = self._source_ranges(projection)
        if kind == "weight":
            part = tensor.narrow(0, *src_rows).narrow(1, *cols)
            quantized_here = load_fp8_weight(weight, scale, self.fp8.scaling, 0, part)
            (self._scaled if quantized_here else self._stored).add((expert, projection))
            return
        if self.fp8.scaling is WeightScaling.PER_ROW and kind == WEIGHT_SCALE:
            load_per_row_scale(scale, 0, src_rows, tensor)
        elif self.fp8.scaling is WeightScaling.BLOCK_128 and kind == WEIGHT_SCALE_INV:
            load_block_scale(scale, (0, weight.shape[0]), src_rows, cols, tensor)
        else:
            raise ModelLoadError(f"expert {expert}: checkpoint tensor {kind!r} does not match the "
                                 f"{self.fp8.scaling.value} FP8 scaling")
        self._scaled.add((expert, projection))

    def _destination(self, expert: int, projection: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's `[rows, K]` weight of the projection and (FP8) its scale rows."""
        local, size = expert - self.owned.start, self.shard_size
        if projection == DOWN:
            return self.w2.data[local], None if self.w2_scale is None else self.w2_scale[local]
        weight = self.w13.data[local].narrow(0, projection * size, size)
        if self.w13_scale is None:
            return weight, None
        per_half = size if self.w13_scale.dim() == 2 else _blocks(size)
        return weight, self.w13_scale[local].narrow(0, projection * per_half, per_half)

    def _source_ranges(self, projection: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """`(rows, columns)` as (start, count) of the checkpoint tensor that this rank holds."""
        mine = (self.shard_start, self.shard_size)
        if projection == DOWN:
            return (0, self.hidden_size), mine
        return mine, (0, self.hidden_size)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)
