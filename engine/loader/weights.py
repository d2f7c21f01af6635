"""The loader's front door: which format a model path is, its `ModelConfig`, and its weights.

Whatever the format, weights come out as `(hf_name, tensor)` pairs with Hugging Face parameter
names and layouts, so our model (`load_weights(iterable)`) and a `transformers` model can load the
very same tensors, and a test can compare them.

Formats (`EngineConfig.load_format`):
- `safetensors`: a HF directory with `config.json` and `*.safetensors` (sharded or not);
- `gguf`: one `.gguf` file, dequantized at load; its config comes from the file's metadata;
- `dummy`: a directory (or `config.json` path) with only the config; seeded random weights;
- `auto`: `detect_format` picks one of the first two. It never picks `dummy`: silently serving
  random weights because someone forgot to copy the checkpoint is worse than an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import ConfigError, ModelLoadError
from engine.loader.dummy import dummy_weights
from engine.loader.gguf_file import has_gguf_magic, open_gguf
from engine.loader.gguf_weights import iter_gguf_weights
from engine.loader.safetensors_weights import iter_safetensors_weights, safetensors_files

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def detect_format(path: str | Path) -> str:
    """`"safetensors"` or `"gguf"` for what lies at `path`; `ModelLoadError` saying why otherwise."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {p} does not exist")
    if p.is_file():
        if has_gguf_magic(p):
            return "gguf"
        raise ModelLoadError(f"{p} is not a GGUF file; a model is a .gguf file or a Hugging Face directory")
    if any(p.glob("*.safetensors")):
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has *.safetensors weights but no config.json")
        return "safetensors"
    ggufs = sorted(p.glob("*.gguf"))
    if ggufs:
        raise ModelLoadError(f"{p} holds GGUF files; pass the file itself, e.g. {ggufs[0]}")
    if (p / "config.json").is_file():
        raise ModelLoadError(
            f"{p} has a config.json but no *.safetensors weights; use load_format='dummy' for random weights"
        )
    raise ModelLoadError(f"{p} is neither a .gguf file nor a directory with config.json and *.safetensors")


def resolve_load_format(path: str | Path, load_format: str = "auto") -> str:
    """The concrete format for `path`: `detect_format` for `"auto"`, else `load_format` checked against it."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    if load_format == "auto":
        return detect_format(path)
    if load_format == "dummy":
        _config_json(path)
        return "dummy"
    found = detect_format(path)
    if found != load_format:
        raise ModelLoadError(f"load_format={load_format!r} but {path} holds a {found} model")
    return found


def load_model_config(path: str | Path, load_format: str = "auto") -> ModelConfig:
    """The `ModelConfig` of the model at `path` (from `config.json`, or from GGUF metadata)."""
    fmt = resolve_load_format(path, load_format)
    if fmt == "gguf":
        return ModelConfig.from_hf_config(open_gguf(path).hf_config())
    return ModelConfig.from_dir(_config_json(path).parent)


def load_model_weights(
    path: str | Path,
    load_format: str,
    config: ModelConfig,
    dtype: torch.dtype | str,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for the model at `path`, each tensor in `dtype` on `device`.

    Validation happens now (missing path, wrong format, unreadable headers raise `ModelLoadError`
    from this call); tensors are produced lazily, one at a time, so peak memory is the model plus
    one tensor. `seed` only matters for `dummy`.
    """
    fmt = resolve_load_format(path, load_format)
    torch_dtype = to_torch_dtype(dtype)
    if fmt == "dummy":
        return dummy_weights(config, torch_dtype, device, seed)
    if fmt == "gguf":
        return iter_gguf_weights(open_gguf(path), config, torch_dtype, device)
    safetensors_files(Path(path))  # fail now on garbage, not on first next()
    return iter_safetensors_weights(Path(path), torch_dtype, device)


def to_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _config_json(path: str | Path) -> Path:
    p = Path(path)
    cfg = p if p.name == "config.json" else p / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"no config.json at {p}")
    return cfg
