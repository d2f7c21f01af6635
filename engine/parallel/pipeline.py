"""Pipeline parallelism inside one worker: the layers split over stages, activations passed between them.

Rank layout (TP x PP): world rank = stage * tp_size + tensor rank. Stage s holds layers
`stage_layers(num_layers, pp, s)` and the KV cache of those layers only; the first stage also holds
the embedding, the last the final norm and the LM head (and the embedding again when the model ties
it to the LM head). World rank 0 (stage 0, tensor rank 0) drives: it owns the batcher and samples.
Inside a stage the tensor ranks shard as usual over their own process group; between stages,
tensor rank r of stage s sends `(hidden, residual)` to tensor rank r of stage s + 1 (point-to-point
over the default group: NCCL on GPU, gloo on CPU). Both tensors are whole on every tensor rank after
the row-parallel all-reduce, so no gather or split is needed at a stage boundary.

One step (`PipelineSchedule.run`): every rank knows the step's plan (rank 0 broadcast it), so every
rank builds the same micro-batches (contiguous groups of the plan's chunks, balanced by token count)
and the same input metadata, and knows the shape of every tensor it will receive. A stage runs its
micro-batches in order: receive (blocking), compute, send (non-blocking, so it starts the next
micro-batch while the next stage works on this one). The last stage computes the sampled rows'
logits and its tensor rank 0 sends them to rank 0, which samples. With M micro-batches and P stages
every stage is busy M of the M + P - 1 slots of a step (fill and drain are idle). That is the
step-at-a-time schedule (`ParallelConfig.pipeline_overlap` off); by default the engine keeps one
batch in flight per stage instead (pipeline_rounds.py), over the same links (`StageLinks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.batch import ScheduledChunk
from engine.errors import ConfigError


@dataclass(frozen=True)
class Activations:
    """What flows from one stage to the next for one micro-batch (both `[T, hidden]`); after the last
    stage's final norm `hidden` is the model output and `residual` is None."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


@dataclass(frozen=True)
class PipelineParallel:
    """This process's stage. `tp_size` / `tp_rank` place its peers: the same tensor rank one stage up
    or down (module docstring)."""

    rank: int = 0  # the stage
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def prev_rank(self) -> int:
        """World rank of the previous stage's process of the same tensor rank."""
        return (self.rank - 1) * self.tp_size + self.tp_rank

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) * self.tp_size + self.tp_rank

    @property
    def sends_logits(self) -> bool:
        """The last stage's tensor rank 0 hands the sampled rows' logits to rank 0 (unless it is rank 0)."""
        return self.is_last and self.tp_rank == 0 and self.size > 1

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.size, self.rank)


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The layers of `stage`: an even split, the first `num_layers % pp_size` stages one layer more
    (the last stage also runs the LM head, so it gets the smaller share)."""
    check_pipeline_parallel(num_layers, pp_size)
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def max_stage_layers(num_layers: int, pp_size: int) -> int:
    """Layers of the largest stage: every stage sizes its KV pool for it, so all have the same block count."""
    return -(-num_layers // pp_size)


def check_pipeline_parallel(num_layers: int, pp_size: int) -> None:
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size ({pp_size}) exceeds the model's layers ({num_layers}); "
                          f"valid sizes: 1..{num_layers}")


def split_microbatches(chunks: Sequence[ScheduledChunk], count: int) -> list[Sequence[ScheduledChunk]]:
    """`chunks` in at most `count` contiguous, non-empty groups of about equal token counts. Contiguous
    keeps the sampled rows in plan order, so the micro-batches' logits concatenate into the step's."""
    count = max(1, min(count, len(chunks)))
    total = sum(len(c.token_ids) for c in chunks)
    groups: list[Sequence[ScheduledChunk]] = []
    start, seen = 0, 0
    for i, c in enumerate(chunks):
        seen += len(c.token_ids)
        groups_left = count - len(groups) - 1
        chunks_left = len(chunks) - i - 1
        if groups_left and (seen * count >= total * (len(groups) + 1) or chunks_left == groups_left):
            groups.append(chunks[start:i + 1])
            start = i + 1
    groups.append(chunks[start:])
    return groups


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the stage function sees it: its number of tokens and sampled rows."""

    num_tokens: int
    num_sampled: int


# Runs this stage on micro-batch i with what the previous stage sent (None on the first stage).
StageFn = Callable[[int, Activations | None], Activations]
# The last stage: the sampled rows' logits `[num_sampled, vocab]` float32 of micro-batch i's output.
LogitsFn = Callable[[int, Activations], torch.Tensor | None]


class StageLinks:
    """This rank's point-to-point links to its neighbour stages. Device, dtype and sizes fix the shape of
    every received tensor; `group` is the activations' point-to-point group (None: the default one),
    `logits_group` the group of rank 0 and the last stage's tensor rank 0 (TensorParallel.logits_group)."""

    def __init__(self, pp: PipelineParallel, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, group: Any = None, logits_group: Any = None) -> None:
        self.pp = pp
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.device = device
        self.group = group
        self.logits_group = logits_group

    def recv_activations(self, num_tokens: int) -> Activations:
        hidden = torch.empty((num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, self.pp.prev_rank, group=self.group)
        dist.recv(residual, self.pp.prev_rank, group=self.group)
        return Activations(hidden, residual)

    def send_activations(self, out: Activations) -> PendingSends:
        """Start sending `out` to the next stage; the caller waits on the result once the receiver must
        have posted its receive (an isend's buffers must live until then)."""
        kept = [out.hidden.contiguous(), _residual(out).contiguous()]
        return PendingSends([dist.isend(t, self.pp.next_rank, group=self.group) for t in kept], kept)

    def exchange_logits(self, parts: list[torch.Tensor], num_sampled: int) -> torch.Tensor | None:
        """The last stage's sampled logits (`parts` concatenated) on the last stage and on rank 0, which
        receives them; None elsewhere and when nothing samples."""
        if num_sampled == 0:
            return None
        if self.pp.is_last:
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
            if self.pp.sends_logits:
                dist.send(out.contiguous(), 0, group=self.logits_group)
            return out
        if self.pp.is_first and self.pp.tp_rank == 0:  # rank 0: the driver samples
            out = torch.empty((num_sampled, self.vocab_size), dtype=torch.float32, device=self.device)
            dist.recv(out, (self.pp.size - 1) * self.pp.tp_size, group=self.logits_group)
            return out
        return None


@dataclass
class PendingSends:
    """Activations on their way to the next stage, with the buffers the sends read from."""

    works: list[Any]
    buffers: list[torch.Tensor]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


class PipelineSchedule:
    """One step through this rank's stage, in micro-batches (module docstring)."""

    def __init__(self, links: StageLinks) -> None:
        self.links = links
        self.pp = links.pp

    def run(self, micro: Sequence[MicroBatch], stage: StageFn, logits: LogitsFn) -> torch.Tensor | None:
        """The step's sampled logits on rank 0 (None when nothing samples) and on the last stage; None
        on the other ranks."""
        sends: list[PendingSends] = []
        parts: list[torch.Tensor] = []
        for i, mb in enumerate(micro):
            incoming = None if self.pp.is_first else self.links.recv_activations(mb.num_tokens)
            out = stage(i, incoming)
            if not self.pp.is_last:
                sends.append(self.links.send_activations(out))
                continue
            part = logits(i, out)
            if part is not None:
                parts.append(part)
        for pending in sends:
            pending.wait()
        return self.links.exchange_logits(parts, sum(mb.num_sampled for mb in micro))


def _residual(out: Activations) -> torch.Tensor:
    assert out.residual is not None, "every stage runs at least one layer, so a residual always flows"
    return out.residual
