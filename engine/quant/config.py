"""Which weights are FP8 and how they are scaled: from a checkpoint's `quantization_config`, or asked for.

Checkpoint formats read (both as published on the Hugging Face hub):
- compressed-tensors "float-quantized" (`quant_method: compressed-tensors`, `format: float-quantized` or
  `naive-quantized`, 8-bit float weights with `strategy` "tensor" or "channel"): `*.weight` e4m3 plus
  `*.weight_scale` (a scalar or `[N, 1]`); its activation scheme is dynamic per token or static per
  tensor (`*.input_scale`) -- we always quantize activations dynamically per token, which is at least as
  accurate, so `input_scale` is read and dropped;
- the block-scaled format (`quant_method: fp8`, `weight_block_size: [128, 128]`, DeepSeek-V3,
  Qwen3-FP8): `*.weight` e4m3 plus `*.weight_scale_inv` `[ceil(N/128), ceil(K/128)]`; dynamic
  activations per token and 128-column group. `quant_method: fp8` without a block size is per-tensor.

Both formats may list modules the checkpoint keeps unquantized (bf16): compressed-tensors `ignore` (a
module name, or `re:<regex>` matched from the start of the name), and `modules_to_not_convert` (Hugging
Face) or `ignored_layers` (vLLM) for `quant_method: fp8` (any part of the name). Such projections load as
plain bf16 layers. A merged projection (q/k/v, gate/up) runs as one matmul, so its parts must agree: a
checkpoint quantizing some but not all of them is refused, as vLLM refuses it.

Online quantization (`--quantization fp8` on a bf16 checkpoint) uses per-output-channel weight scales
and dynamic per-token activation scales, the recipe with the smallest accuracy loss `_scaled_mm` runs
at full speed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

QUANTIZATION_METHODS = ("fp8",)
BLOCK = 128  # the block edge of the block-scaled format (weights) and of its activation groups


class IgnoreMatch(enum.Enum):
    """How a checkpoint's list of unquantized modules names them."""

    NAME_OR_REGEX = "name_or_regex"  # compressed-tensors `ignore`: the whole name, or `re:<regex>` (re.match)
    SUBSTRING = "substring"  # `modules_to_not_convert` / `ignored_layers`: any part of the name


class WeightScaling(enum.Enum):
    """How a quantized weight's dequantization scales are laid out (see engine/quant/fp8.py)."""

    PER_ROW = "per_row"  # one float32 per output channel (per-tensor checkpoints expand into it)
    BLOCK_128 = "block_128"  # one float32 per 128 x 128 tile


@dataclass(frozen=True)
class Fp8Config:
    """The model's dense projections hold e4m3 weights scaled by `scaling`.

    `from_checkpoint`: the checkpoint stores e4m3 weights and their scales (so every projection must
    come with its scale); False: bf16/fp32 weights quantized as they load.
    """

    scaling: WeightScaling = WeightScaling.PER_ROW
    from_checkpoint: bool = False
    ignore: tuple[str, ...] = ()  # modules left unquantized, Hugging Face names (see the module docstring)
    ignore_match: IgnoreMatch = IgnoreMatch.NAME_OR_REGEX

    def ignores(self, module: str) -> bool:
        """Whether the projection `module` (e.g. `model.layers.0.self_attn.q_proj`) stays unquantized."""
        if self.ignore_match is IgnoreMatch.SUBSTRING:
            return any(pattern in module for pattern in self.ignore)
        return any(re.match(pattern[3:], module) if pattern.startswith("re:") else pattern == module
                   for pattern in self.ignore)

    def ignores_merged(self, modules: Sequence[str]) -> bool:
        """Whether a merged projection of `modules` stays unquantized; `ConfigError` if only some of its
        parts are (one matmul has one precision)."""
        ignored = [self.ignores(m) for m in modules]
        if any(ignored) and not all(ignored):
            kept = [m for m, i in zip(modules, ignored, strict=True) if i]
            raise ConfigError(f"the FP8 checkpoint leaves {', '.join(kept)} unquantized but not the rest of "
                              f"{', '.join(modules)}, which run as one matmul; all of them must share a precision")
        return all(ignored)


def checkpoint_fp8_config(hf: dict[str, Any]) -> Fp8Config | None:
    """The FP8 format of a config.json's `quantization_config`; None when the checkpoint is unquantized.
    A quantization this engine cannot run raises `ConfigError` naming what is supported."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _block_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ConfigError(f"unsupported quantization_config quant_method {method!r}; supported: fp8, "
                      "compressed-tensors (float-quantized 8-bit)")


def resolve_fp8_config(requested: str | None, checkpoint: Fp8Config | None) -> Fp8Config | None:
    """The weights' FP8 config given `--quantization` and the checkpoint's own format: a quantized
    checkpoint runs as stored; `fp8` on an unquantized one quantizes it at load."""
    if requested not in (None, *QUANTIZATION_METHODS):
        raise ConfigError(f"unknown quantization {requested!r}; valid: none, {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint is not None:
        return checkpoint
    return Fp8Config() if requested == "fp8" else None


def _ignore_list(qc: dict[str, Any], *keys: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in keys:
        value = qc.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"quantization_config {key} must be a list of module names, got {value!r}")
        names.extend(value)
    return tuple(names)


def _block_fp8(qc: dict[str, Any]) -> Fp8Config:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"unsupported fp8 format {fmt!r}; supported: e4m3")
    ignore = _ignore_list(qc, "modules_to_not_convert", "ignored_layers")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Config(WeightScaling.PER_ROW, True, ignore, IgnoreMatch.SUBSTRING)
    if list(block) != [BLOCK, BLOCK]:
        raise ConfigError(f"unsupported weight_block_size {block}; supported: [{BLOCK}, {BLOCK}]")
    return Fp8Config(WeightScaling.BLOCK_128, True, ignore, IgnoreMatch.SUBSTRING)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Config:
    fmt = qc.get("format")
    ignore = _ignore_list(qc, "ignore")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ConfigError(f"unsupported compressed-tensors format {fmt!r}; supported: float-quantized")
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError(f"compressed-tensors group {name!r}: only 8-bit float weights are supported, "
                              f"got {weights.get('num_bits')}-bit {weights.get('type')}")
        strategy = weights.get("strategy")
        if strategy == "block" and list(weights.get("block_structure") or []) == [BLOCK, BLOCK]:
            return Fp8Config(WeightScaling.BLOCK_128, True, ignore)
        if strategy not in ("tensor", "channel"):
            raise ConfigError(f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not "
                              f"supported; supported: tensor, channel, block [{BLOCK}, {BLOCK}]")
    return Fp8Config(WeightScaling.PER_ROW, True, ignore)
