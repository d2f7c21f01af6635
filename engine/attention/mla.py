"""Attention over the latent KV cache (DeepSeek MLA): the latent store, absorbed decode, expanded prefill.

The cache is `[num_blocks, num_layers, 1, block_size, 1, C + R]` (engine/kv_cache.py, `KVLayout.LATENT`):
per token the normed latent `c` (C = kv_lora_rank) and the rotated shared key (R = qk_rope_head_dim).

- Decode (one query per sequence, the bandwidth-bound step) never expands the cache: the caller folds
  W_UK into the query, so each head attends over `[c | k_rope]` as its key and `c` as its value (MQA
  with one wide head); `latent_decode` runs the Triton kernel (engine/kernels/mla_decode.py) with the
  Triton backend, else the torch reference below.
- Steps with prefill chunks are compute-bound, and the absorbed form would cost C + R instead of
  qk_head_dim per score: `expanded_context` decompresses the step's context blocks through kv_b_proj
  into a temporary K/V cache of ordinary heads, and the backend's paged attention runs over that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import gather_blocks


def uses_triton(backend: AttentionBackend) -> bool:
    """The Triton backend runs the Triton MLA kernels, like its own: on CUDA, or on CPU under the
    interpreter (tests); the kernels' wrappers refuse any other device."""
    return backend.name == "triton"


def write_latent(backend: AttentionBackend, kv_cache: torch.Tensor, layer: int, entries: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store `entries [T, C + R]` into their slots of layer `layer` (negative slot: padding row, skipped)."""
    if uses_triton(backend):
        from engine.kernels.mla_decode import store_latent  # imports triton: CUDA only

        store_latent(kv_cache, layer, entries.to(kv_cache.dtype).contiguous(), slot_mapping)
        return
    keep = slot_mapping >= 0
    slots, entries = slot_mapping[keep], entries[keep]
    block_size = kv_cache.shape[3]
    kv_cache[:, layer, 0, :, 0][slots // block_size, slots % block_size] = entries.to(kv_cache.dtype)


def latent_decode(backend: AttentionBackend, query: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  meta: AttentionMetadata, scale: float, latent_dim: int) -> torch.Tensor:
    """`query [B, H, C + R]` (absorbed) -> `[B, H, C]`: each head's attention-weighted latent."""
    if uses_triton(backend):
        from engine.kernels.mla_decode import mla_decode
        from engine.kernels.paged_decode import choose_num_splits

        splits = choose_num_splits(meta.num_seqs, 1, _sm_count(query.device), meta.max_seq_len)
        return mla_decode(query.contiguous(), kv_cache, layer, meta.block_tables, meta.seq_lens, scale,
                          latent_dim, splits)
    return latent_decode_reference(query, kv_cache, layer, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                                   scale, latent_dim)


def latent_decode_reference(query: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, max_len: int, scale: float, latent_dim: int) -> torch.Tensor:
    """The torch reference of the decode kernel: gather every sequence's latents, masked SDPA."""
    batch, num_heads, width = query.shape
    plane = kv_cache[:, layer, 0]  # [num_blocks, block_size, 1, C + R]
    table = block_tables[:, : -(-max_len // plane.shape[1])]
    keys = gather_blocks(plane, table).transpose(1, 2)  # [B, 1, S_pad, C + R]
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = torch.zeros((batch, keys.shape[2]), dtype=query.dtype, device=query.device)
    mask.masked_fill_(positions >= seq_lens.unsqueeze(1), float("-inf"))
    out = F.scaled_dot_product_attention(query.view(batch, 1, num_heads, width), keys, keys[..., :latent_dim],
                                         attn_mask=mask.view(batch, 1, 1, -1), scale=scale)
    return out.reshape(batch, num_heads, latent_dim)


@dataclass(frozen=True)
class ExpandedContext:
    """The step's context as an ordinary K/V cache of one layer, and the metadata that reads it."""

    kv_cache: torch.Tensor  # [n, 1, 2, block_size, H, D], D = max(qk_head_dim, v_head_dim), zero-padded
    meta: AttentionMetadata  # block tables renumbered into `kv_cache`


def expanded_context(kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata, kv_b_weight: torch.Tensor,
                     nope_dim: int, v_dim: int) -> ExpandedContext:
    """Decompress each sequence's context blocks: `k = [W_UK c | k_rope]`, `v = W_UV c` for every head.

    `kv_b_weight [H * (nope + v), C]` is kv_b_proj's weight. The blocks of sequence i become rows
    `offset_i .. offset_i + n_i` of the new cache (sequences sharing a prefix expand it twice)."""
    block_size, width = kv_cache.shape[3], kv_cache.shape[5]
    latent_dim = kv_b_weight.shape[1]
    num_heads = kv_b_weight.shape[0] // (nope_dim + v_dim)
    counts = [-(-n // block_size) for n in meta.seq_lens_cpu]
    ids = torch.cat([meta.block_tables[i, :n] for i, n in enumerate(counts)]).long()
    plane = kv_cache[:, layer, 0, :, 0].index_select(0, ids)  # [N, block_size, C + R]
    kv = F.linear(plane[..., :latent_dim], kv_b_weight).view(len(ids), block_size, num_heads, nope_dim + v_dim)
    rope = plane[..., latent_dim:width].unsqueeze(2).expand(-1, -1, num_heads, -1)
    dim = max(nope_dim + width - latent_dim, v_dim)
    expanded = kv_cache.new_zeros((len(ids), 1, 2, block_size, num_heads, dim))
    expanded[:, 0, 0, ..., :nope_dim] = kv[..., :nope_dim]
    expanded[:, 0, 0, ..., nope_dim:nope_dim + width - latent_dim] = rope
    expanded[:, 0, 1, ..., :v_dim] = kv[..., nope_dim:]
    table = torch.zeros((len(counts), max(counts)), dtype=torch.int32)
    start = 0
    for i, n in enumerate(counts):
        table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return ExpandedContext(expanded, replace(meta, block_tables=table.to(kv_cache.device, non_blocking=True)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of the device; 1 off CUDA, where only the interpreter runs."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
