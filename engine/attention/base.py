"""The attention backend interface: the torch reference (CPU, CI) and Triton (CUDA) implement it.

A step's tokens are flattened into one varlen batch: sequence `i` owns the query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the *last* `query_len` positions of its context
of `seq_lens[i]` tokens (cached prefix + new tokens), so a decode is a query of length 1 and a prefill
chunk attends causally to the cached blocks plus itself.

Rules a caller may rely on:
- `write_kv` runs before `attend` for the same layer in the same step; after it, every new token's
  K/V is in its slot, so `attend` reads the whole context from the paged cache alone.
- Backends never allocate or free blocks and never keep references to tensors across steps, so a
  CUDA graph may capture `write_kv` + `attend` over persistent metadata buffers.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.layers.rotary import apply_rotary


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step inputs of attention, built once per step by the model runner (shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] int64: slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query lengths, query_start_loc[0] == 0
    seq_lens: torch.Tensor  # [B] int32: context length per sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, rows padded with 0
    max_query_len: int  # host copies, so no backend needs a device->host sync
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class KVScale:
    """Dequantization scales of one layer's K and V in an FP8 cache (`real = stored * scale`; the store
    divides by them). Per tensor and per layer, from the checkpoint's `k_scale`/`v_scale` where it has
    them, else 1.0. Caches in the activation dtype ignore them."""

    k: float = 1.0
    v: float = 1.0


UNSCALED = KVScale()


class AttentionBackend(ABC):
    """Paged attention over `kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`."""

    name: str

    @abstractmethod
    def write_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        layer: int,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        slot_mapping: torch.Tensor,  # [T] int64
        kv_scale: KVScale = UNSCALED,
    ) -> None:
        """Scatter the new tokens' K and V into their slots of layer `layer` (an FP8 cache stores
        `x / scale`, saturated to e4m3's range)."""

    def rotate_and_write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        query: torch.Tensor,  # [T, H_q, D]
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D/2] in the activation dtype
        slot_mapping: torch.Tensor,  # [T] int64
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor:  # [T, H_q, D]: the rotated query
        """Apply RoPE to q and k, write k and v into the cache, return the rotated q. Backends with a
        fused kernel override this; the result must equal this reference."""
        query, key = apply_rotary(query, *rope), apply_rotary(key, *rope)
        self.write_kv(kv_cache, layer, key, value, slot_mapping, kv_scale)
        return query

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,  # [T, H_q, D]
        kv_cache: torch.Tensor,
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor:  # [T, H_q, D]
        """Causal attention of each sequence's queries over its paged context (GQA: H_q % H_kv == 0).
        An FP8 cache is read as `stored * kv_scale`; the result is in the query's dtype."""

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int, max_num_seqs: int, dtype: torch.dtype) -> None:
        """Compile whatever a step may need, before serving (a compile mid-step stalls every request
        of that step). Nothing to do for backends without JIT kernels."""
        return None


_REGISTRY = {
    "torch": "engine.attention.torch_ref:TorchAttentionBackend",
    "triton": "engine.attention.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> AttentionBackend:
    """Backends are picked by name; the heavy import (triton) happens only here."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown attention backend {name!r}; valid: {', '.join(_REGISTRY)}")
    module_name, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls()
