"""The Triton attention backend (CUDA): KV store, split-KV paged decode, paged prefill/extend.

A decode-only step (every sequence has one query token) runs the split-KV decode kernel; any step
with a longer query (prefill chunks, possibly with decode rows mixed in) runs the varlen prefill
kernel, which handles a query of length 1 like any other.

CUDA graphs: the decode launch depends on the host only through the batch shape and `num_splits`.
Without `decode_num_splits` the split count is picked from the batch and the step's `max_seq_len`,
so a captured graph freezes the count of its capture step. That is safe: any split count is correct
for any context length (the kernels read `seq_lens` on the device); only its speed varies. Fix
`decode_num_splits` to choose the count a graph runs with.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import ConfigError
from engine.kernels.dispatch import use_fused_kernels
from engine.kernels.kv_store import store_kv
from engine.kernels.paged_decode import MAX_SPLITS, choose_num_splits, paged_decode
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
    ) -> None:
        store_kv(kv_cache, layer, key, value, slot_mapping)

    def rotate_and_write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """One fused RoPE + KV-store kernel (`BATON_FUSED_KERNELS=0`: the reference's separate ops)."""
        if not use_fused_kernels(query):
            return super().rotate_and_write_kv(kv_cache, layer, query, key, value, rope, slot_mapping)
        return rope_and_store_kv(kv_cache, layer, query, key, value, *rope, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,  # [T, H_q, D]
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        layer: int,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H_q, D]
        if meta.is_decode_only:
            if query.shape[0] != meta.num_seqs:
                raise ValueError(
                    f"decode step: query has {query.shape[0]} rows for {meta.num_seqs} sequences"
                )
            splits = self._decode_num_splits or choose_num_splits(
                meta.num_seqs, kv_cache.shape[4], self._sm_count(query.device), meta.max_seq_len
            )
            return paged_decode(query, kv_cache, layer, meta.block_tables, meta.seq_lens, scale, splits)
        return paged_prefill(
            query, kv_cache, layer, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
        )

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int, max_num_seqs: int, dtype: torch.dtype) -> None:
        """Prefill/mixed steps: one kernel variant per sequence-count bucket and tile shape; compiled
        here at start, else ~1 s each in the middle of serving (seen in the DistServe runs)."""
        start = time.perf_counter()
        n = warm_up_prefill(kv_cache, num_q_heads, max_num_seqs, dtype)
        log.info("warmed %d paged-prefill kernel variants in %.1f s", n, time.perf_counter() - start)

    def _sm_count(self, device: torch.device) -> int:
        """Multiprocessors of the device (cached); 1 off CUDA, where only the interpreter runs."""
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
            )
        return self._num_sms[device]
