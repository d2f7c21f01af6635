"""The only engine component that owns the device: weights, the KV cache, input tensors, sampling.

`execute(plan)` is a pure function of the plan and the KV cache. A decode-only step (one token per
sequence) no larger than the largest captured batch replays a CUDA graph over persistent input
buffers (`engine/cuda_graphs.py`); every other step (prefill chunks, mixed batches, CPU, the torch
backend, `enforce_eager`) builds one flattened varlen batch and runs the model eagerly. Either way
one token is sampled for every chunk that reaches the end of its known tokens. A chunk that carries a
speculative draft is sampled at each of its positions and verified (`engine/speculative/verify.py`).

Host syncs: inputs go host->device through pinned memory with non-blocking copies; the one wait of
a step is reading the sampled token ids back.

Tensor parallelism: every rank runs `execute` on the same plan (the launcher broadcasts it). The
logits are all-gathered, so every rank holds them whole, but only rank 0 samples: the tokens matter
only to rank 0's batcher, and they reach the other ranks inside the next plan. Followers return an
empty `StepResult`. Decode graphs capture the NCCL collectives too: every rank replays the same graph
for the same plan, so the captured all-reduces meet.

Pipeline parallelism: every rank runs `execute` on the same plan too; each stage runs its layers over
the step's micro-batches and passes activations on (engine/parallel/pipeline.py), the last stage's
logits come back to rank 0, which samples. With overlap on (the default) the engine calls
`pipeline_round` instead: one batch in flight per stage, each stage running a different plan in each
round (engine/parallel/pipeline_rounds.py); `pipeline_depth` tells the engine how many. Steps run
eagerly (no decode graphs yet), and each stage's KV cache holds its layers only, sized so that every
stage has the same number of blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from engine.attention.base import AttentionMetadata, get_attention_backend
from engine.batch import BatchPlan, ScheduledChunk, StepResult
from engine.choices import ChoiceRows, choice_rows
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphRunner, capture_sizes
from engine.input_buffers import DecodeInputBuffers
from engine.kernels.dispatch import fused_kernels_enabled
from engine.kv_cache import kv_cache_spec_for, kv_dtype_name
from engine.models import get_model_class
from engine.models.llama import LlamaForCausalLM
from engine.parallel.group import TensorParallel, local_kv_heads, mark_collectives_captured
from engine.parallel.pipeline import (
    Activations,
    MicroBatch,
    PipelineSchedule,
    StageLinks,
    max_stage_layers,
    split_microbatches,
)
from engine.parallel.pipeline_rounds import PipelineRounds, StageOutput
from engine.quant.config import resolve_fp8_config
from engine.sampler import Sampler
from engine.speculative.verify import accept_drafts, verification_rows
from engine.structured.masks import MaskJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingSample:
    """Rank 0's sampling of one plan, begun before its logits exist."""

    chunks: list[ScheduledChunk]  # the chunks that sample, in plan order
    rows: list[ScheduledChunk]  # one per sampled position
    extra: ChoiceRows  # sibling choices' first tokens (n > 1)
    masks: MaskJob | None


@dataclass(frozen=True)
class CompletedStep:
    """A plan that left the overlapped pipeline, with its sampled tokens."""

    plan: BatchPlan
    result: StepResult


@dataclass(frozen=True)
class StepInputs:
    """Device tensors of one eager step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] int64: row of `hidden` whose logits are sampled, per sampling chunk


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor]], tp: TensorParallel | None = None) -> None:
        """`tp`: this process's tensor-parallel rank (from the launcher); None runs on `config.device`."""
        self.config = config
        self.model_config = model_config
        self.tp = tp or TensorParallel(device=torch.device(config.device))
        self.device = self.tp.device
        self.dtype = getattr(torch, config.dtype)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.backend = get_attention_backend(config.attention_backend)
        self.model = self._build_model(weights)
        stage = self.tp.pipeline
        self.kv_spec = kv_cache_spec_for(
            num_layers=len(stage.layers(model_config.num_layers)),  # this stage's layers
            num_kv_heads=local_kv_heads(model_config.num_kv_heads, self.tp.size),  # this rank's heads
            head_dim=model_config.head_dim,
            latent_dim=model_config.mla.latent_dim if model_config.mla else None,
            block_size=config.cache.block_size,
            dtype=kv_dtype_name(config.dtype, config.cache.kv_cache_dtype),
        )
        # Block ids are the same on every stage: size the pool for the largest stage.
        sizing = replace(self.kv_spec, num_layers=max_stage_layers(model_config.num_layers, stage.size))
        self.num_blocks = config.cache.num_blocks or sizing.num_blocks_for(config.cache.memory_bytes)
        self.kv_cache = self.kv_spec.allocate(self.num_blocks, self.device)
        self.sampler = Sampler(seed=config.seed, device=self.device)
        if self.device.type == "cuda" and model_config.mla is None:  # MLA's kernels compile on first use
            self.backend.warm_up(self.kv_cache, model_config.num_heads // self.tp.size,
                                 config.batcher.max_num_seqs, self.dtype)
        self.graphs = self._build_graphs()
        links = (StageLinks(stage, model_config.hidden_size, model_config.vocab_size, self.dtype, self.device,
                            logits_group=self.tp.logits_group) if stage.size > 1 else None)
        self.schedule = PipelineSchedule(links) if links is not None else None
        # Batches in flight across steps (engine/parallel/pipeline_rounds.py), unless turned off.
        self.rounds = (PipelineRounds(links, self._run_stage)
                       if links is not None and config.parallel.pipeline_overlap else None)

    def _build_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> LlamaForCausalLM:
        start = time.perf_counter()
        cls = get_model_class(self.model_config.architecture)
        with torch.device(self.device):
            model = cast(LlamaForCausalLM, cls(self.model_config, self.backend, self.tp))
            model.to(self.dtype)
        fp8 = resolve_fp8_config(self.config.quantization, self.model_config.fp8)
        if fp8 is not None:
            model.use_fp8(fp8)  # after .to(dtype), which would cast e4m3 storage back up
        model.load_weights(weights)
        model.eval()
        log.info("model %s loaded in %.2fs (tp rank %d/%d, ep rank %d/%d, pp stage %d/%d)",
                 self.model_config.architecture, time.perf_counter() - start, self.tp.rank, self.tp.size,
                 self.tp.expert.rank, self.tp.expert.size, self.tp.pipeline.rank, self.tp.pipeline.size)
        return model

    def expert_load(self) -> torch.Tensor | None:
        """Per-expert token counts of the MoE layers, `[sparse layers, E]` (see LlamaForCausalLM.expert_load).
        Engine thread only: it reads device memory the next step writes."""
        return self.model.expert_load()

    def release_graphs(self) -> None:
        """Before leaving a tensor-parallel group: drop the decode graphs (see DecodeGraphRunner.release)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _build_graphs(self) -> DecodeGraphRunner | None:
        """Capture decode graphs, or None where steps run eagerly (see the module docstring)."""
        cfg = self.config
        if cfg.enforce_eager or self.device.type != "cuda" or self.backend.name != "triton":
            return None
        if self.tp.pipeline.size > 1:  # a stage's graph would end at a send: not built yet
            return None
        if self.model_config.moe is not None and (not fused_kernels_enabled() or self.tp.expert.size > 1):
            # The torch reference MoE loops over the experts it finds, and expert parallelism reads the
            # all-to-all's counts: a host sync per layer either way.
            return None
        sizes = capture_sizes(cfg.cuda_graph_batch_sizes, cfg.batcher.max_num_seqs)
        if not sizes:
            return None
        block_size = self.kv_spec.block_size
        max_blocks = min(-(-self.max_model_len // block_size), self.num_blocks)
        buffers = DecodeInputBuffers(max(sizes), max_blocks, block_size, self.device)
        mode = "thread_local" if self.tp.world_size > 1 else "global"
        graphs = DecodeGraphRunner(self._decode_logits, buffers, sizes, self.max_model_len, mode,
                                   align=self.tp.barrier)
        graphs.capture()
        self.model.reset_expert_load()  # capture ran the forward on padding rows
        if self.tp.world_size > 1:
            mark_collectives_captured()
        return graphs

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The captured function: forward pass plus LM head for every row."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta))

    @property
    def pipeline_depth(self) -> int:
        """Batches the engine may keep in flight: one per stage with overlapped pipeline rounds, else 1
        (`execute`, one step at a time)."""
        return self.rounds.depth if self.rounds is not None else 1

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        if plan.is_empty:
            return StepResult(sampled={})
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        pending = self._begin_sampling(plan) if self.tp.is_driver else None  # overlaps the forward
        if self.graphs is not None and self.graphs.can_run(plan.chunks):
            logits = self._sampled_rows(self.graphs.run(plan.chunks), plan.chunks)
        elif self.schedule is not None:
            logits = self._run_pipelined(self.schedule, plan.chunks)
        else:
            logits = self._run_eager(plan.chunks)
        if logits is None or pending is None:
            return StepResult(sampled={})
        return self._sample(pending, logits)

    @torch.inference_mode()
    def pipeline_round(self, plan: BatchPlan) -> CompletedStep | None:
        """One round of the overlapped pipeline (engine/parallel/pipeline_rounds.py): `plan` (possibly
        empty, a bubble) enters stage 0, this rank runs its stage's plan, and the plan leaving the last
        stage is sampled. Returns that plan and its tokens on rank 0; None on the other ranks, while
        the pipeline fills, and when the leaving plan is a bubble."""
        assert self.rounds is not None, "pipeline_round needs pipeline stages with overlap on"
        self.rounds.submit(plan)
        left = self.rounds.collect()
        if left is None or left.plan.is_empty or not self.tp.is_driver:
            return None
        if left.logits is None:  # nothing in it samples (e.g. only middle prefill chunks)
            return CompletedStep(left.plan, StepResult(sampled={}))
        return CompletedStep(left.plan, self._sample(self._begin_sampling(left.plan), left.logits))

    def _run_stage(self, plan: BatchPlan, incoming: Activations | None) -> StageOutput:
        """This stage's layers over a whole plan (one micro-batch: the other stages have batches of
        their own); the last stage also computes the sampled rows' logits."""
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)  # each stage copies its own layers' blocks
        x = self.prepare_inputs(plan.chunks)
        out = self.model.forward_stage(x.input_ids, x.positions, self.kv_cache, x.meta, incoming)
        if not self.tp.pipeline.is_last:
            return StageOutput(out)
        rows = x.sample_rows
        return StageOutput(None, self.model.compute_logits(out.hidden.index_select(0, rows)) if rows.numel() else None)

    def _begin_sampling(self, plan: BatchPlan) -> PendingSample:
        """Rank 0: the rows to sample and any grammar masks, started before the logits exist."""
        chunks = [c for c in plan.chunks if c.needs_sample]
        rows = verification_rows(chunks)  # one per sampled position (several for a draft)
        extra = choice_rows(chunks)  # n > 1: sibling choices' first tokens
        return PendingSample(chunks, rows, extra, self.sampler.begin([*rows, *extra.rows]))

    def _sample(self, pending: PendingSample, logits: torch.Tensor) -> StepResult:
        rows, extra, chunks = pending.rows, pending.extra, pending.chunks
        if extra.rows:
            logits = torch.cat([logits, logits.index_select(0, self._tensor(list(extra.source_rows), torch.int64))])
        tokens = self.sampler.sample(logits, [*rows, *extra.rows], pending.masks)
        tokens, siblings = tokens[:len(rows)], tokens[len(rows):]
        if len(rows) > len(chunks):
            result = accept_drafts(chunks, tokens)
        else:
            result = StepResult(sampled={c.request_id: t for c, t in zip(chunks, tokens, strict=True)})
        return replace(result, choices=extra.split(chunks, siblings)) if extra.rows else result

    def _copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of forked choices' shared blocks (block-major: one row per block), before any
        of this step's KV writes."""
        src = self._tensor([s for s, _ in copies], torch.int64)
        dst = self._tensor([d for _, d in copies], torch.int64)
        raw = self.kv_cache.view(torch.uint8)  # bytes: index_copy_ has no float8 kernel on CPU
        raw.index_copy_(0, dst, raw.index_select(0, src))

    def _run_eager(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """Logits of the sampling chunks' sampled rows (the last, or every verified position of a
        draft), or None when no chunk samples."""
        inputs = self.prepare_inputs(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        if inputs.sample_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def _run_pipelined(self, schedule: PipelineSchedule, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """`_run_eager` through this rank's pipeline stage, in micro-batches (engine/parallel/pipeline.py):
        the sampled rows' logits on rank 0 and the last stage, None elsewhere."""
        count = self.config.parallel.pipeline_microbatches or schedule.pp.size
        inputs = [self.prepare_inputs(group) for group in split_microbatches(chunks, count)]
        micro = [MicroBatch(i.input_ids.numel(), i.sample_rows.numel()) for i in inputs]

        def stage(i: int, incoming: Activations | None) -> Activations:
            x = inputs[i]
            return self.model.forward_stage(x.input_ids, x.positions, self.kv_cache, x.meta, incoming)

        def logits(i: int, out: Activations) -> torch.Tensor | None:
            rows = inputs[i].sample_rows
            return self.model.compute_logits(out.hidden.index_select(0, rows)) if rows.numel() else None

        return schedule.run(micro, stage, logits)

    def _sampled_rows(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """The graph computed logits for every row; keep the rows of chunks that sample."""
        rows = [i for i, c in enumerate(chunks) if c.needs_sample]
        if len(rows) == len(chunks):
            return logits
        return logits.index_select(0, self._tensor(rows, torch.int64)) if rows else None

    def prepare_inputs(self, chunks: Sequence[ScheduledChunk]) -> StepInputs:
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
                sample_rows.extend(range(len(input_ids) - c.num_sampled_rows, len(input_ids)))
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

    @torch.inference_mode()
    def randomize_kv_cache(self, seed: int) -> None:
        """Fill the whole KV pool with N(0, 1) values. Benchmarks only: they set context lengths
        directly instead of prefilling, and timing kernels on the zeroed pool would flatter them."""
        gen = torch.Generator(device=self.device).manual_seed(seed + self.tp.rank)
        if not self.kv_spec.is_fp8:
            self.kv_cache.normal_(generator=gen)
            return
        for chunk in self.kv_cache.split(1024):  # float8 has no normal_: fill through bf16 temporaries
            chunk.copy_(torch.empty(chunk.shape, dtype=torch.bfloat16, device=self.device).normal_(generator=gen))
