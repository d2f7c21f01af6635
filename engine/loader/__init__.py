"""Model loading: safetensors directories, GGUF files and dummy weights, all under Hugging Face names.

Public entry points (see each module's docstring for the why):
- `load_model(spec, load_format, dtype, device)`: config + tokenizer + lazy weights in one call;
- `resolve_model(spec)` / `default_model_dir()`: where the model is (the default is prepared once);
- `load_model_config(path, load_format)`: its `ModelConfig`;
- `load_model_weights(path, load_format, config, dtype)`: `(hf_name, tensor)` pairs for `load_weights`.
"""

from engine.loader.loaded_model import LoadedModel, load_model
from engine.loader.prepare import DEFAULT_MODEL_NAME, default_model_dir
from engine.loader.resolve import resolve_model
from engine.loader.weights import (
    LOAD_FORMATS,
    detect_format,
    load_model_config,
    load_model_weights,
    resolve_load_format,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "LoadedModel",
    "default_model_dir",
    "detect_format",
    "load_model",
    "load_model_config",
    "load_model_weights",
    "resolve_load_format",
    "resolve_model",
]
