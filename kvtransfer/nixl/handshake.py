"""Build and check the handshake a NIXL KV agent sends to its peers."""

from __future__ import annotations

import torch

from kvtransfer.base import HandshakeInfo
from kvtransfer.layout import KVLayoutInfo


def validate_kv_tensor(kv_cache: torch.Tensor, layout: KVLayoutInfo) -> None:
    """The tensor must be the whole block-major pool `layout` describes, in one contiguous region."""
    spec = layout.to_spec()
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: one block = one contiguous region")
    if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != spec.block_shape:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not [num_blocks, *{spec.block_shape}] "
            "(num_layers, 2, block_size, num_kv_heads, head_dim)"
        )
    if kv_cache.dtype != spec.torch_dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not the layout's {layout.dtype}")
    if kv_cache.device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv_cache device {kv_cache.device} is not cpu or cuda")


def describe_local(
    agent_name: str, agent_metadata: bytes, kv_cache: torch.Tensor, layout: KVLayoutInfo
) -> HandshakeInfo:
    """The HandshakeInfo of a registered KV tensor. Take `agent_metadata` *after* registering the
    tensor, or the peer's prepared descriptor list will not find the region (NIXL_ERR_NOT_FOUND)."""
    validate_kv_tensor(kv_cache, layout)
    return HandshakeInfo(
        layout=layout,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        base_address=kv_cache.data_ptr(),
        num_blocks=kv_cache.shape[0],
        bytes_per_block=layout.bytes_per_block,
        device_kind=kv_cache.device.type,
        device_id=kv_cache.device.index or 0,
    )
