"""The only engine component that owns the device: weights, the KV cache, input tensors, sampling.

`execute(plan)` is a pure function of the plan and the KV cache: it builds one flattened varlen batch
(prefill chunks and decode tokens together), runs the model once, and samples one token for every
chunk that reaches the end of its known tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata, get_attention_backend
from engine.batch import BatchPlan, ScheduledChunk, StepResult
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheSpec
from engine.models import get_model_class
from engine.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """Device tensors of one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64: row of `hidden` whose logits are sampled, per sampling chunk


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.backend = get_attention_backend(config.attention_backend)
        self.model = self._build_model(weights)
        self.kv_spec = KVCacheSpec(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            block_size=config.cache.block_size,
            dtype=config.dtype,
        )
        self.num_blocks = config.cache.num_blocks or self.kv_spec.num_blocks_for(config.cache.memory_bytes)
        self.kv_cache = self.kv_spec.allocate(self.num_blocks, self.device)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        self._pin = self.device.type == "cuda"

    def _build_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
        start = time.perf_counter()
        cls = get_model_class(self.model_config.architecture)
        with torch.device(self.device):
            model = cls(self.model_config, self.backend).to(self.dtype)
        model.load_weights(weights)
        model.eval()
        log.info("model %s loaded in %.2fs", self.model_config.architecture, time.perf_counter() - start)
        return model

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        inputs = self.prepare_inputs(plan.chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        sampling_chunks = [c for c in plan.chunks if c.needs_sample]
        if not sampling_chunks:
            return StepResult(sampled={})
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        tokens = self.sampler.sample(logits, sampling_chunks)
        return StepResult(sampled={c.request_id: t for c, t in zip(sampling_chunks, tokens, strict=True)})

    def prepare_inputs(self, chunks: tuple[ScheduledChunk, ...] | list[ScheduledChunk]) -> StepInputs:
        """Flatten the chunks into host lists, then copy to the device once per tensor."""
        bs = self.kv_spec.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        for c in chunks:
            input_ids.extend(c.token_ids)
            for pos in range(c.start_pos, c.context_len):
                positions.append(pos)
                slots.append(c.block_ids[pos // bs] * bs + pos % bs)
            query_start.append(len(input_ids))
            seq_lens.append(c.context_len)
            if c.needs_sample:
                sample_rows.append(len(input_ids) - 1)
        max_blocks = max(-(-n // bs) for n in seq_lens)
        tables = [list(c.block_ids[:max_blocks]) + [0] * (max_blocks - min(len(c.block_ids), max_blocks))
                  for c in chunks]
        query_lens = tuple(b - a for a, b in zip(query_start, query_start[1:], strict=False))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            query_start_loc=self._tensor(query_start, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=tuple(seq_lens),
        )
        return StepInputs(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            meta=meta,
            sample_rows=self._tensor(sample_rows, torch.int64),
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor; on CUDA through pinned memory with a non-blocking copy."""
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)
