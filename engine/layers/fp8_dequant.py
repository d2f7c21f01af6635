"""FP8 checkpoint tensors of a part the engine holds in the activation dtype, dequantized as they load.

An FP8 checkpoint (DeepSeek-V3, Qwen3-FP8: 128 x 128 block scales; compressed-tensors: per-channel or
per-tensor scales) stores each projection as an e4m3 `weight` plus its scale, in any order. A few
weights are kept in `--dtype` even in an FP8 model: MLA's kv_b_proj (absorbed into batched matmuls in
decode, engine/layers/mla.py) and an MoE router or shared-expert gate if a checkpoint quantized them
(engine/layers/moe.py). This pairs each such e4m3 weight with its scale and gives back the dequantized
values: exact (every e4m3 value times its scale is representable in float32 and rounds once to bf16).
"""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.quant.fp8 import FP8_DTYPE, dequantize_weight
from engine.quant.fp8_load import INPUT_SCALE, SCALE_KINDS, WEIGHT_SCALE_INV


class Fp8Dequantizer:
    """Pairs `<base>.weight` (e4m3) with `<base>.weight_scale` / `.weight_scale_inv`; `take` returns the
    dequantized float32 weight once both have arrived."""

    def __init__(self) -> None:
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, tuple[str, torch.Tensor]] = {}

    @staticmethod
    def wants(kind: str, tensor: torch.Tensor) -> bool:
        """Whether a tensor of this kind (`weight`, a scale kind) belongs to an FP8 pair."""
        return kind in SCALE_KINDS or (kind == "weight" and tensor.dtype == FP8_DTYPE)

    def take(self, base: str, kind: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Keep one half of `base`'s pair; the dequantized weight when this completes it, else None."""
        if kind == INPUT_SCALE:
            return None  # static activation scales: the block runs unquantized activations
        if kind == "weight":
            self._weights[base] = tensor
        else:
            self._scales[base] = (kind, tensor.float())
        if base not in self._weights or base not in self._scales:
            return None
        weight, (scale_kind, scale) = self._weights.pop(base), self._scales.pop(base)
        if scale_kind != WEIGHT_SCALE_INV:  # per-channel [N, 1] / [N] or per-tensor [1]
            scale = scale.reshape(-1).expand(weight.shape[0]) if scale.numel() == 1 else scale.reshape(-1)
        try:
            return dequantize_weight(weight, scale)
        except RuntimeError as e:  # a scale of the wrong shape for its weight
            raise ModelLoadError(f"{base}: FP8 scale of shape {tuple(scale.shape)} does not fit weight "
                                 f"{tuple(weight.shape)}: {e}") from e

    def check_complete(self, prefix: str) -> None:
        """Raise if a weight's scale (or a scale's weight) never came."""
        unpaired = sorted({*self._weights} ^ {*self._scales})
        if unpaired:
            raise ModelLoadError(f"{prefix}{unpaired[0]}: FP8 weight without its scale, or scale without its "
                                 f"weight ({len(unpaired)} unpaired in this block)")
