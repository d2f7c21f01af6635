"""The paged KV cache layout shared by the engine, the attention backends and kvtransfer.

One tensor per worker, block-major across layers:

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block (every layer's K and V for `block_size` tokens) is one contiguous region of
`bytes_per_block` bytes, and moving a block between workers is one NIXL descriptor. A token's
*slot* is `block_id * block_size + offset`.

Latent attention (DeepSeek's MLA, engine/layers/mla.py) caches one vector per token and layer, the
compressed latent followed by the shared rotary key, from which both keys and values are derived:

    kv_cache[num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]

(`KVLayout.LATENT`: one plane, one "head"). Every block-level consumer (block copies, checksums, host
and disk tiers, NIXL descriptors) sees an opaque contiguous block either way.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from engine.errors import ConfigError

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
FP8_KV_DTYPE = "float8_e4m3fn"  # `--kv-cache-dtype fp8_e4m3`: one byte per value, per-layer K/V scales


def kv_dtype_name(model_dtype: str, kv_cache_dtype: str) -> str:
    """The cache's element dtype (a `KVCacheSpec.dtype`) for `CacheConfig.kv_cache_dtype`: "auto" keeps
    the model's dtype, "fp8_e4m3" stores e4m3 (values divided by their layer's K or V scale)."""
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8_e4m3" else model_dtype


class KVLayout(Enum):
    KEY_VALUE = "key_value"  # planes 0 and 1: each KV head's keys and values (MHA, GQA)
    LATENT = "latent"  # plane 0 only: MLA's latent + rotary key, one head of head_dim features


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16" | "float8_e4m3fn"
    layout: KVLayout = KVLayout.KEY_VALUE

    def __post_init__(self) -> None:
        if self.layout is KVLayout.LATENT and self.num_kv_heads != 1:
            raise ConfigError(f"a latent KV cache has one head, got num_kv_heads={self.num_kv_heads}")

    @property
    def planes(self) -> int:
        """2 (K and V) or 1 (the latent)."""
        return 1 if self.layout is KVLayout.LATENT else 2

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [num_layers, planes, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, self.planes, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over every layer (what a hand-off moves per prompt token)."""
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE

    def num_blocks_for(self, memory_bytes: int) -> int:
        n = memory_bytes // self.bytes_per_block
        if n < 2:
            raise ConfigError(
                f"KV memory budget {memory_bytes} B holds {n} blocks of {self.bytes_per_block} B; need >= 2"
            )
        return n

    def allocate(self, num_blocks: int, device: str | torch.device) -> torch.Tensor:
        """Allocate the whole pool as one tensor. Zeroed so an unwritten slot never holds NaN garbage."""
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.torch_dtype, device=device)

    def fingerprint(self) -> str:
        """Stable hash of the layout, part of the kvtransfer compatibility check."""
        fields = {**asdict(self), "layout": self.layout.value}
        if self.layout is KVLayout.KEY_VALUE:
            del fields["layout"]  # GQA fingerprints stay what they were before latent layouts existed
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]


def kv_cache_spec_for(num_layers: int, num_kv_heads: int, head_dim: int, latent_dim: int | None,
                      block_size: int, dtype: str) -> KVCacheSpec:
    """The cache of a model: GQA's `num_kv_heads` heads of `head_dim` (this rank's), or, with
    `latent_dim` (MLA's kv_lora_rank + qk_rope_head_dim), one latent head of that width."""
    if latent_dim is not None:
        return KVCacheSpec(num_layers, 1, latent_dim, block_size, dtype, KVLayout.LATENT)
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, dtype)
