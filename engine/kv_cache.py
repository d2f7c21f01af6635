"""The paged KV cache layout shared by the engine, the attention backends and kvtransfer.

One tensor per worker, block-major across layers:

    kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block (every layer's K and V for `block_size` tokens) is one contiguous region of
`bytes_per_block` bytes, and moving a block between workers is one NIXL descriptor. A token's
*slot* is `block_id * block_size + offset`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from engine.errors import ConfigError

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * _DTYPE_BYTES[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

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
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:16]
