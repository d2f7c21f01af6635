"""GGUF tensors, dequantized, under Hugging Face names and in Hugging Face layout.

Three things differ from a HF checkpoint besides the names:
- MoE experts: llama.cpp stacks one projection of all a layer's experts in one tensor
  (`blk.N.ffn_gate_exps`, `[E, I, H]`); it is dequantized once and yielded per expert under the
  checkpoint's per-expert names;
- quantized blocks (Q4_1, Q8_0, K-quants, ...) are dequantized with `gguf.quants.dequantize` (numpy,
  one tensor at a time, so peak host memory is one fp32 tensor, not the model);
- for LLaMA-architecture files llama.cpp's converter permutes the rows of q_proj/k_proj from HF's
  "rotate halves" RoPE layout to its own "interleaved pairs" layout; `unpermute_rotary` undoes it.
  Without this the model still loads and runs, but attention is garbage: the test that a prepared
  SmolLM2 answers "Paris" under `transformers` is what proves it right.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.loader.dummy import hf_parameter_shapes
from engine.loader.gguf_deepseek import kv_b_from_split
from engine.loader.gguf_file import PERMUTED_QK_ARCHITECTURES, GGUFFile

_GGUF_ARCH_ENUM = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# `model.layers.3.mlp.experts.17.gate_proj.weight` -> (`model.layers.3.mlp.experts`, `17`, `gate_proj`)
_KV_B = ".self_attn.kv_b_proj.weight"  # DeepSeek's; new llama.cpp files split it (attn_k_b, attn_v_b)
_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight$")


def hf_to_gguf_names(gfile: GGUFFile, config: ModelConfig) -> dict[str, str]:
    """Map each HF parameter name the config implies to the GGUF tensor holding it.

    Uses `gguf`'s own name table (the one llama.cpp's converter writes with) instead of a copy.
    """
    table = gguf.get_tensor_name_map(_GGUF_ARCH_ENUM[gfile.arch], config.num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_parameter_shapes(config):
        expert = _EXPERT_NAME.match(hf_name)
        # One expert's projection lives in the GGUF tensor of all the layer's experts of that projection.
        lookup = f"{expert.group(1)}.{expert.group(3)}.weight" if expert else hf_name
        lookup = lookup.replace("e_score_correction_bias", "e_score_correction.bias")  # DeepSeek-V3's
        gguf_name = table.get_name(lookup, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None and hf_name.endswith(_KV_B) and gguf_name not in gfile.tensors:
            gguf_name = gguf_name.replace("attn_kv_b", "attn_k_b")  # split for absorbed MLA: gguf_deepseek.py
        if gguf_name is None:
            raise ModelLoadError(f"no GGUF tensor name for {hf_name} (architecture {gfile.arch})")
        mapping[hf_name] = gguf_name
    missing = [g for g in mapping.values() if g not in gfile.tensors]
    if missing:
        raise ModelLoadError(
            f"GGUF file {gfile.path} lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}"
        )
    return mapping


def iter_gguf_weights(
    gfile: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every parameter of `config`, dequantized to `dtype` on `device`."""
    expected = hf_parameter_shapes(config)
    permute = gfile.arch in PERMUTED_QK_ARCHITECTURES
    stacked: tuple[str, torch.Tensor] | None = None  # the experts' tensor being read, dequantized once
    for hf_name, gguf_name in hf_to_gguf_names(gfile, config).items():
        expert = _EXPERT_NAME.match(hf_name)
        if gguf_name.endswith(".attn_k_b.weight"):
            tensor = kv_b_from_split(torch.from_numpy(_dequantize(gfile, gguf_name)),
                                     torch.from_numpy(_dequantize(gfile, gguf_name.replace("attn_k_b", "attn_v_b"))))
        elif expert is None:
            tensor = torch.from_numpy(_dequantize(gfile, gguf_name))
        else:
            if stacked is None or stacked[0] != gguf_name:
                stacked = gguf_name, torch.from_numpy(_dequantize(gfile, gguf_name))
            tensor = _expert_slice(stacked[1], int(expert.group(2)), gguf_name)
        if tuple(tensor.shape) != expected[hf_name]:
            raise ModelLoadError(
                f"GGUF tensor {gguf_name} has shape {tuple(tensor.shape)}, config implies {expected[hf_name]}"
            )
        if permute and ".self_attn.q_proj." in hf_name:
            tensor = unpermute_rotary(tensor, config.num_heads)
        elif permute and ".self_attn.k_proj." in hf_name:
            tensor = unpermute_rotary(tensor, config.num_kv_heads)
        yield hf_name, tensor.to(device=device, dtype=dtype)


def _expert_slice(stacked: torch.Tensor, expert: int, gguf_name: str) -> torch.Tensor:
    """Expert `expert` of a `[E, rows, cols]` GGUF experts tensor."""
    if stacked.dim() != 3 or expert >= stacked.shape[0]:
        raise ModelLoadError(f"GGUF tensor {gguf_name} of shape {tuple(stacked.shape)} has no expert {expert}")
    return stacked[expert]


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute(w, n_head)`.

    Per head llama.cpp reorders rows [x0..x(d/2-1), y0..y(d/2-1)] into pairs (x0, y0, x1, y1, ...):
    `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`. The inverse reads the pairs back out:
    `w.reshape(n_head, d/2, 2, ...).swapaxes(1, 2)`. Works for weights [out, in] and biases [out].
    """
    out = weight.shape[0]
    if out % (2 * num_heads):
        raise ModelLoadError(f"cannot unpermute a {tuple(weight.shape)} q/k weight over {num_heads} heads")
    half = out // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _dequantize(gfile: GGUFFile, gguf_name: str) -> np.ndarray:
    t = gfile.tensors[gguf_name]
    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        kind = t.tensor_type.name
        raise ModelLoadError(f"GGUF tensor {gguf_name} uses unsupported quantization {kind}") from e
    except (ValueError, IndexError) as e:
        raise ModelLoadError(f"GGUF tensor {gguf_name} in {gfile.path} is corrupt: {e}") from e
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost-first
    data = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    return data if data.flags.writeable else data.copy()  # F32 tensors are read-only views of the mmap
