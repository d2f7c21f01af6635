"""One call from a model spec to everything the engine needs: config, tokenizer, lazy weights."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader.gguf_file import open_gguf
from engine.loader.resolve import resolve_model
from engine.loader.weights import load_model_config, load_model_weights
from tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    path: Path  # the resolved model location (the prepared dir for the default model)
    load_format: str  # concrete format: safetensors | gguf | dummy
    model_config: ModelConfig
    tokenizer: Tokenizer | None  # None for a dummy model whose dir has no tokenizer.json
    weights: Iterator[tuple[str, torch.Tensor]]  # lazy, single pass: hand it to `load_weights` once


def load_model(
    model: str | Path | None,
    load_format: str = "auto",
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Resolve `model` (None, "" or "SmolLM2-135M-Instruct" mean the prepared default) and open it.

    Raises `ModelLoadError` (bad path or files) or `ConfigError` (bad config values) before any
    weight is read; the weights iterator then reads one tensor at a time.
    """
    path, fmt = resolve_model(model, load_format, cache_dir)
    config = load_model_config(path, fmt)
    weights = load_model_weights(path, fmt, config, dtype, device=device, seed=seed)
    return LoadedModel(path, fmt, config, _tokenizer_for(path, fmt), weights)


def _tokenizer_for(path: Path, load_format: str) -> Tokenizer | None:
    if load_format == "gguf":
        return Tokenizer.from_gguf(open_gguf(path))
    model_dir = path.parent if path.name == "config.json" else path
    if load_format == "dummy" and not (model_dir / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(model_dir)
