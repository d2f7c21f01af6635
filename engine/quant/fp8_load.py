"""Writing checkpoint tensors into an FP8 projection's weight and scale storage.

A projection's storage is `weight[N, K]` e4m3 and `scale` (`[N]` per row, or `[ceil(N/128), ceil(K/128)]`
per 128 x 128 block). Tensor parallelism and merged projections (q/k/v, gate/up) mean one checkpoint
tensor fills a range of rows (`row0`, column-parallel) or of columns (row-parallel) of it; callers pass
the checkpoint tensor already cut to this rank's slice plus where it lands. Block scales can only be cut
on 128-row/column boundaries, so a slice that is not aligned raises `ModelLoadError` rather than mixing
scales of two blocks.

A floating-point (bf16/fp32) tensor arriving for an FP8 projection is quantized on the way in, in the
projection's own scaling: this is online quantization, and it also covers dummy weights and checkpoints
that leave some projections unquantized.
"""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.quant.config import WeightScaling
from engine.quant.fp8 import BLOCK, FP8_DTYPE, quantize_blocks, quantize_rows

# Checkpoint tensors beside an FP8 weight: its dequantization scale (per-tensor/-channel, or per block),
# and a static activation scale we do not use (activations are always scaled per token at run time).
WEIGHT_SCALE = "weight_scale"
WEIGHT_SCALE_INV = "weight_scale_inv"
INPUT_SCALE = "input_scale"
SCALE_KINDS = (WEIGHT_SCALE, WEIGHT_SCALE_INV, INPUT_SCALE)


def load_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, scaling: WeightScaling, row0: int,
                    src: torch.Tensor) -> bool:
    """Write `src` (this rank's slice, `[rows, K_local]`) at `weight[row0:]`; True when it was quantized
    here, so its scale is written too (a float tensor), False for stored e4m3 (its scale comes separately)."""
    rows = src.shape[0]
    if src.dim() != 2 or src.shape[1] != weight.shape[1] or row0 + rows > weight.shape[0]:
        raise ModelLoadError(f"weight slice shape {tuple(src.shape)} does not fit rows {row0}.. of "
                             f"{tuple(weight.shape)}")
    dst = weight.narrow(0, row0, rows)
    if src.dtype == FP8_DTYPE:
        dst.copy_(src)
        return False
    if not src.is_floating_point():
        raise ModelLoadError(f"weight of dtype {src.dtype} cannot be loaded into an FP8 projection")
    if scaling is WeightScaling.PER_ROW:
        q, s = quantize_rows(src)
        scale.narrow(0, row0, rows).copy_(s)
    else:
        if row0 % BLOCK or (rows % BLOCK and row0 + rows != weight.shape[0]):
            raise ModelLoadError(f"block-scaled FP8: rows {row0}+{rows} of {weight.shape[0]} are not "
                                 f"{BLOCK}-aligned")
        q, s = quantize_blocks(src)
        scale.narrow(0, row0 // BLOCK, s.shape[0]).copy_(s)
    dst.copy_(q)
    return True


def load_per_row_scale(scale: torch.Tensor, dst_row0: int, src_rows: tuple[int, int],
                       src: torch.Tensor) -> None:
    """A per-tensor (one value) or per-channel (`[N]` / `[N, 1]`) checkpoint scale: this rank's rows
    `src_rows = (start, count)` of it land at `scale[dst_row0:]`. A per-tensor scale is repeated."""
    start, count = src_rows
    dst = scale.narrow(0, dst_row0, count)
    if src.numel() == 1:
        dst.fill_(float(src.reshape(())))
        return
    flat = src.reshape(-1)
    if flat.numel() < start + count:
        raise ModelLoadError(f"weight_scale has {flat.numel()} values; rows up to {start + count} needed")
    dst.copy_(flat.narrow(0, start, count))


def load_block_scale(scale: torch.Tensor, dst_rows: tuple[int, int], src_rows: tuple[int, int],
                     cols: tuple[int, int], src: torch.Tensor) -> None:
    """A `[ceil(N/128), ceil(K/128)]` checkpoint block scale: weight rows `src_rows = (start, count)` of
    the checkpoint and weight columns `cols = (start, count)` of it land at weight rows `dst_rows[0]`."""
    (d0, _), (s0, nr), (c0, nc) = dst_rows, src_rows, cols
    for name, value in (("destination row", d0), ("checkpoint row", s0), ("column", c0)):
        if value % BLOCK:
            raise ModelLoadError(f"block-scaled FP8: {name} offset {value} is not a multiple of {BLOCK}; "
                                 "this tensor-parallel split cuts through a scale block")
    nbr, nbc = -(-nr // BLOCK), -(-nc // BLOCK)
    if src.dim() != 2 or src.shape[0] < s0 // BLOCK + nbr or src.shape[1] < c0 // BLOCK + nbc:
        raise ModelLoadError(f"weight_scale_inv shape {tuple(src.shape)} too small for rows {s0}+{nr}, "
                             f"columns {c0}+{nc}")
    scale.narrow(0, d0 // BLOCK, nbr).narrow(1, 0, nbc).copy_(src[s0 // BLOCK:][:nbr, c0 // BLOCK:][:, :nbc])
