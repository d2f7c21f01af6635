"""Tensors of a Hugging Face safetensors directory, one file and one tensor at a time.

Shard files come from `model.safetensors.index.json` when present (so stray files such as a
`consolidated.safetensors` next to the shards are ignored), else from every `*.safetensors` file.
Headers are parsed up front, so a garbage or truncated file fails when loading starts with a
`ModelLoadError` naming it, not half-way through filling the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters save that are not parameters: RoPE is recomputed from the config.
_SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)
# FP8 checkpoints' weight, activation and KV scales (engine/quant/).
_SCALE_SUFFIXES = ("_scale", "_scale_inv")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`, validated to exist and to have readable headers."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"invalid {index}: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    for f in files:
        _check_header(f)
    return files


def iter_safetensors_weights(
    model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor in the directory, cast to `dtype` on `device`.

    Tensors are read straight onto `device` (safetensors copies from the memory map), then cast
    there, so a bf16 checkpoint loaded as fp16 on a GPU never makes a host-side fp32 copy.
    """
    device_str = str(torch.device(device))
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device=device_str) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if name.endswith(_SKIPPED_SUFFIXES):
                        continue
                    yield name, _cast(name, f.get_tensor(name), dtype)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError / OSError on a file that changed or is cut short
            raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from e


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model dtype, except what FP8 checkpoints must keep: e4m3 weights stay e4m3 (the model holds them
    so), and their scales float32 (a bf16 scale would add its own rounding to every weight)."""
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor
    if name.endswith(_SCALE_SUFFIXES):
        return tensor.float()
    return tensor.to(dtype)


def _check_header(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"safetensors file {path} is missing")
    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as e:
        raise ModelLoadError(f"{path} is not a valid safetensors file: {e}") from e
