"""A GGUF file's metadata read into Hugging Face terms: `config.json` values and tensor names.

llama.cpp names everything its own way (`llama.block_count`, `blk.0.attn_q.weight`); the rest of the
engine speaks Hugging Face (`num_hidden_layers`, `model.layers.0.self_attn.q_proj.weight`) so that
our model and a `transformers` model load the very same tensors. This module is the one place that
translates, and the only importer of `gguf`'s reader.

Opening is cheap in memory (the reader memory-maps the file) but parses every metadata array, about
3 s for a 49k-token vocabulary; `open_gguf` shares one `GGUFFile` per unchanged file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from engine.errors import ModelLoadError
from engine.loader.gguf_deepseek import DEEPSEEK_GGUF_ARCH, deepseek_hf_config

# GGUF `general.architecture` -> (HF architecture, HF model_type).
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),  # llama.cpp also writes Mistral/SmolLM this way
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # and V3: engine/loader/gguf_deepseek.py
}
# llama.cpp writes Mixtral as a "llama" file with experts; its graph renormalises the top-k weights for
# these (Mixtral, Qwen3-MoE) and not for Qwen2-MoE, unless the file says (`expert_weights_norm`).
MIXTRAL = ("MixtralForCausalLM", "mixtral")
RENORMALIZED_EXPERT_ARCHITECTURES = ("llama", "qwen3moe")
# llama.cpp's converter interleaves q/k rows for these (its `LlamaModel.permute`); see `unpermute_rotary`.
PERMUTED_QK_ARCHITECTURES = ("llama",)
GGUF_MAGIC = b"GGUF"


class GGUFFile:
    """An open GGUF file: typed metadata access, the HF config it implies, and its tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file {self.path} does not exist")
        if not has_gguf_magic(self.path):
            raise ModelLoadError(f"{self.path} is not a GGUF file (no 'GGUF' magic at its start)")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError/IndexError/OSError on truncated files
            raise ModelLoadError(f"cannot read GGUF file {self.path} (truncated or corrupt?): {e}") from e
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = str(self.get("general.architecture", ""))
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {self.arch!r} in {self.path}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` as a Python scalar, str or list; `default` when absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"corrupt metadata {key!r} in GGUF file {self.path}: {e}") from e

    def arch_get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped metadata, e.g. `arch_get("block_count")` reads `llama.block_count`."""
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} lacks metadata {self.arch}.{key}")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` dict of the HF model in this file (input of `ModelConfig.from_hf_config`)."""
        hf_arch, model_type = GGUF_ARCHITECTURES[self.arch]
        hidden = int(self.require("embedding_length"))
        num_heads = int(self.require("attention.head_count"))
        num_kv_heads = int(self.arch_get("attention.head_count_kv") or num_heads)
        tokens = self.get("tokenizer.ggml.tokens") or []
        rope_theta = _f32(self.arch_get("rope.freq_base", 10000.0))
        rope = {"rope_type": "default", "rope_theta": rope_theta, **self._rope_scaling()}
        eos = self.get("tokenizer.ggml.eos_token_id")
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "vocab_size": int(self.arch_get("vocab_size") or len(tokens)),
            "hidden_size": hidden,
            "intermediate_size": int(self.require("feed_forward_length")),
            "num_hidden_layers": int(self.require("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": int(self.arch_get("attention.key_length") or hidden // num_heads),
            "max_position_embeddings": int(self.arch_get("context_length", 2048)),
            "rms_norm_eps": _f32(self.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": rope_theta,  # transformers 4 reads this, 5 reads rope_parameters
            "rope_parameters": rope,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "mlp_bias": False,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos,
            "pad_token_id": self.get("tokenizer.ggml.padding_token_id"),
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }
        if rope["rope_type"] != "default":
            config["rope_scaling"] = rope
        if self.arch == DEEPSEEK_GGUF_ARCH:
            return deepseek_hf_config(self, config)
        if self.arch_get("expert_count"):
            config.update(self._moe_config())
        return config

    def _moe_config(self) -> dict[str, Any]:
        """The config.json keys of a mixture-of-experts file (Mixtral's names for a "llama" file)."""
        experts = int(self.arch_get("expert_count"))
        renormalize = self.arch_get("expert_weights_norm", self.arch in RENORMALIZED_EXPERT_ARCHITECTURES)
        moe: dict[str, Any] = {"num_experts_per_tok": int(self.require("expert_used_count")),
                               "norm_topk_prob": bool(renormalize)}
        if self.arch == "llama":
            return {**moe, "architectures": [MIXTRAL[0]], "model_type": MIXTRAL[1], "num_local_experts": experts}
        shared = int(self.arch_get("expert_shared_feed_forward_length", 0))
        return {**moe, "num_experts": experts, "moe_intermediate_size": int(self.require("expert_feed_forward_length")),
                "shared_expert_intermediate_size": shared}

    def _rope_scaling(self) -> dict[str, Any]:
        """Llama-3.x rope scaling, which llama.cpp stores as a `rope_freqs` tensor, not as metadata.

        The tensor holds the per-frequency divisors; its maximum is `factor`. The other three values
        are not recoverable from it; every Llama 3.1/3.2 release uses the ones below.
        """
        freqs = self.tensors.get("rope_freqs.weight")
        if freqs is None:
            return {}
        factor = float(gguf.quants.dequantize(freqs.data, freqs.tensor_type).max())
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }


def open_gguf(path: str | Path) -> GGUFFile:
    """A `GGUFFile`, shared while the file is unchanged: config, weights and tokenizer each need one."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise ModelLoadError(f"GGUF file {p} does not exist") from e
    return _open_cached(str(p), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
