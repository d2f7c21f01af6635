"""`baton-tiny-random`: a second, much smaller model that needs no download, for multi-model serving.

A 2-layer Llama (hidden size 64) with seeded random weights (`load_format="dummy"`) and the default
model's tokenizer and chat template. It is a real second model to the scheduler and the gateway (its
own workers, fleet and name) and, sharing the default model's tokenizer, a valid degraded-mode
fallback for it; its answers are noise, not language. Prepared once, next to the default model:

    <cache_dir>/models/baton-tiny-random/
        config.json              TINY_CONFIG
        generation_config.json, tokenizer.json, tokenizer_config.json   copied from the default model
        baton-prepared.json      marker (load format: dummy)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from engine.loader.prepare import (
    FORMAT_VERSION,
    MARKER_FILE,
    default_cache_dir,
    default_model_dir,
    exclusive_lock,
    is_prepared,
    make_readable,
    replace_dir,
    write_json,
)

TINY_MODEL_NAME = "baton-tiny-random"
TINY_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 49152,  # the default model's tokenizer
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32",
}
_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The prepared directory of `baton-tiny-random` (preparing the default model first if needed)."""
    target = Path(cache_dir or default_cache_dir()).expanduser() / "models" / TINY_MODEL_NAME
    if is_prepared(target):
        return target
    source = default_model_dir(cache_dir)
    with exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_prepared(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            write_json(tmp / "config.json", TINY_CONFIG)
            for name in _COPIED:
                shutil.copyfile(source / name, tmp / name)
            write_json(tmp / MARKER_FILE, {"source": f"random weights, tokenizer of {source}",
                                           "load_format": "dummy", "format_version": FORMAT_VERSION})
            make_readable(tmp)
            replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
