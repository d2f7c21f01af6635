"""Pipeline parallelism across steps: up to P batches in flight, each on its own stage.

The step-at-a-time schedule (`PipelineSchedule`) leaves every stage idle during each step's fill and
drain, because rank 0 cannot plan step k + 1 before it has sampled step k. Here the batcher plans
batches of disjoint sequences (a sequence is in at most one batch in flight), so rank 0 can issue
batch k + 1 into stage 0 while batch k is on a later stage, as vLLM's virtual engines and SGLang's
pipeline event loop do.

One round (`submit` then `collect`, on every rank, once per broadcast plan):
- every rank receives plan r from rank 0's broadcast and appends it to its window;
- stage s runs plan r - s: stage 0 the new plan, stage s > 0 the plan that stage s - 1 ran in round
  r - 1 (its activations were sent then, so the receive does not wait on a computation);
- the plan that the last stage ran, r - P + 1, leaves the pipeline: the last stage sends its sampled
  rows' logits to rank 0, which samples them in this round.

Why each stage works one round behind the previous one: the broadcast meets every rank (a gloo send
completes only once its receiver is there), so rank 0 can broadcast plan r only when every stage has
ended round r - 1. Were stage 1 to run plan r in round r, it would wait for stage 0's activations of
that same round, and the stages would take turns again. With the lag every stage computes in every
round of a full pipeline, on a different batch.

Sends: a stage's activations of round r are received by the next stage in round r + 1, after the
broadcast, so the sender waits for its sends one round later (waiting in the same round would wait on
a rank that is itself waiting at the next broadcast). The logits are sent and received in one round.

Empty plans are bubbles: rank 0 broadcasts one when nothing new can be scheduled while batches are in
flight, so that they move on and leave. Every rank derives every tensor shape from the plans of its
window, which are the same on every rank, in the same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.batch import BatchPlan
from engine.parallel.pipeline import Activations, PendingSends, StageLinks


@dataclass(frozen=True)
class StageOutput:
    """What this stage made of its plan: activations for the next stage, or on the last stage the
    sampled rows' logits (None when no chunk samples)."""

    activations: Activations | None
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class LeftPipeline:
    """The plan that left the pipeline this round, and its sampled logits (on rank 0 and the last stage)."""

    plan: BatchPlan
    logits: torch.Tensor | None


# Runs this stage's layers on a plan, given what the previous stage sent (None on the first stage).
StageRun = Callable[[BatchPlan, Activations | None], StageOutput]


class PipelineRounds:
    """This rank's side of the overlapped pipeline (module docstring). Not thread-safe: the caller runs
    one round at a time, in broadcast order."""

    def __init__(self, links: StageLinks, run_stage: StageRun) -> None:
        self.links = links
        self.pp = links.pp
        self._run_stage = run_stage
        self._window: deque[BatchPlan] = deque()  # plans r - P + 1 .. r, oldest first
        self._sends: PendingSends | None = None  # last round's activations, on their way
        self._logits: torch.Tensor | None = None  # the last stage's logits of this round's plan

    @property
    def depth(self) -> int:
        """Batches the pipeline holds at once: one per stage."""
        return self.pp.size

    @property
    def num_in_flight(self) -> int:
        """Plans submitted and not yet left, bubbles included."""
        return len(self._window)

    def submit(self, plan: BatchPlan) -> None:
        """Round r's plan enters; this stage runs its plan of the round (r - stage), if any."""
        self._window.append(plan)
        earlier, self._sends = self._sends, None
        self._logits = None
        mine = self._window[-1 - self.pp.rank] if len(self._window) > self.pp.rank else None
        if mine is not None and not mine.is_empty:
            incoming = None if self.pp.is_first else self.links.recv_activations(mine.num_tokens)
            out = self._run_stage(mine, incoming)
            if out.activations is not None:
                self._sends = self.links.send_activations(out.activations)
            self._logits = out.logits
        if earlier is not None:
            earlier.wait()  # the next stage received them in this round, before it computed

    def collect(self) -> LeftPipeline | None:
        """The plan leaving the pipeline this round, once it is full (None before): its logits go from
        the last stage to rank 0 here."""
        if len(self._window) < self.depth:
            return None
        leaving = self._window.popleft()
        num_sampled = sum(c.num_sampled_rows for c in leaving.chunks)
        parts = [self._logits] if self._logits is not None else []
        logits = self.links.exchange_logits(parts, num_sampled)
        self._logits = None
        return LeftPipeline(leaving, logits)
