"""The Triton attention backend (CUDA): KV store, split-KV paged decode, paged prefill/extend.

A decode-only step (every sequence has one query token) runs the split-KV decode kernel; a step
with longer queries runs the varlen prefill kernel, and the decode rows mixed into it (sequences
with one query token) run as `MIXED_DECODE_ROWS` says: inline in the prefill launch with a decode
tile, or in the decode kernel's varlen mode (engine/kernels/paged_mixed.py).
Tile shapes and split counts come from the shape-class tables in engine/kernels/attention_tiles.py.

CUDA graphs: the decode launch depends on the host only through the batch shape, `num_splits` and
the tile config. Without `decode_num_splits` the split count and tiles are picked from the batch and
the step's `max_seq_len`, so a captured graph freezes those of its capture step. That is safe: any
split count and tile shape is correct for any context length (the kernels read `seq_lens` on the
device); only speed varies. Fix `decode_num_splits` to choose the count a graph runs with.

FP8 cache: the store kernels quantize; the attention kernels cast each K/V tile to the query's dtype,
and the K scale folds into the softmax scale and the V scale into the output (one multiply, skipped
at the default 1.0), so the attention kernels themselves need no scale arguments.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.base import UNSCALED, AttentionBackend, AttentionMetadata, KVScale
from engine.errors import ConfigError
from engine.kernels.attention_tiles import MIXED_DECODE_ROWS, DecodeRows, decode_config
from engine.kernels.dispatch import use_fused_kernels
from engine.kernels.kv_store import store_kv
from engine.kernels.paged_decode import MAX_SPLITS, paged_decode
from engine.kernels.paged_mixed import paged_mixed
from engine.kernels.paged_mixed import warm_up as warm_up_mixed
from engine.kernels.paged_prefill import paged_prefill
from engine.kernels.paged_prefill import warm_up as warm_up_prefill
from engine.kernels.rope_kv_store import rope_and_store_kv

log = logging.getLogger(__name__)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels; fp32 accumulation for float32/bfloat16/float16 caches."""

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        """`decode_num_splits`: fixed split-KV count for decode (1..MAX_SPLITS); None picks per step."""
        if decode_num_splits is not None and not 1 <= decode_num_splits <= MAX_SPLITS:
            raise ConfigError(f"decode_num_splits must be None or in 1..{MAX_SPLITS}, got {decode_num_splits}")
        self._decode_num_splits = decode_num_splits
        self._num_sms: dict[torch.device, int] = {}

    def write_kv(
        self,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        layer: int,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,  # [T, H_kv, D]
        slot_mapping: torch.Tensor,  # [T] int64, negative = padded row, skipped
        kv_scale: KVScale = UNSCALED,
    ) -> None:
        store_kv(kv_cache, layer, key, value, slot_mapping, kv_scale.k, kv_scale.v)

    def rotate_and_write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor:
        """One fused RoPE + KV-store kernel (`BATON_FUSED_KERNELS=0`: the reference's separate ops)."""
        if not use_fused_kernels(query):
            return super().rotate_and_write_kv(kv_cache, layer, query, key, value, rope, slot_mapping, kv_scale)
        return rope_and_store_kv(kv_cache, layer, query, key, value, *rope, slot_mapping, kv_scale.k, kv_scale.v)

    def attend(
        self,
        query: torch.Tensor,  # [T, H_q, D]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        layer: int,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor:  # [T, H_q, D]
        out = self._attend(query, kv_cache, layer, meta, scale * kv_scale.k)
        return out if kv_scale.v == 1.0 else out.mul_(kv_scale.v)

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if meta.is_decode_only:
            if query.shape[0] != meta.num_seqs:
                raise ValueError(
                    f"decode step: query has {query.shape[0]} rows for {meta.num_seqs} sequences"
                )
            num_sms = self._sm_count(query.device)
            config = decode_config(meta.num_seqs, kv_cache.shape[4], num_sms, meta.max_seq_len)
            splits = self._decode_num_splits or config.num_splits(
                meta.num_seqs, kv_cache.shape[4], num_sms, meta.max_seq_len
            )
            return paged_decode(query, kv_cache, layer, meta.block_tables, meta.seq_lens, scale, splits,
                                block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages)
        num_decode_rows = sum(1 for q_len in meta.query_lens_cpu if q_len == 1)
        if MIXED_DECODE_ROWS == DecodeRows.DECODE_KERNEL and num_decode_rows:
            return paged_mixed(query, kv_cache, layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               scale, num_decode_rows, self._sm_count(query.device), meta.max_seq_len)
        # Without decode rows the kernel variant without the decode-row branch runs (PREFILL_TILES).
        return paged_prefill(
            query, kv_cache, layer, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            decode_rows=MIXED_DECODE_ROWS if num_decode_rows else DecodeRows.PREFILL_TILES,
        )

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int, max_num_seqs: int, dtype: torch.dtype) -> None:
        """Prefill/mixed steps: one kernel variant per sequence-count bucket and tile shape; compiled
        here at start, else ~1 s each in the middle of serving (seen in the DistServe runs)."""
        start = time.perf_counter()
        n = warm_up_prefill(kv_cache, num_q_heads, max_num_seqs, dtype)
        if MIXED_DECODE_ROWS == DecodeRows.DECODE_KERNEL:
            n += warm_up_mixed(kv_cache, num_q_heads, dtype)
        log.info("warmed %d paged-prefill kernel variants in %.1f s", n, time.perf_counter() - start)

    def _sm_count(self, device: torch.device) -> int:
        """Multiprocessors of the device (cached); 1 off CUDA, where only the interpreter runs."""
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
        return self._num_sms[device]
