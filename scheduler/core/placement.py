"""Predicting what a request would see on a (decode worker, prefill worker or local) pair.

TTFT = wait for a decode slot (only when the worker's max_num_seqs slots are all taken)
       + prefill queue ahead + own prefill (+ the decode step it shares when prefilled locally)
       + KV transfer of the blocks the decode worker lacks (remote prefill only)
TPOT = decode step time with this request added, at its mid-life context length, the batch
       the mean over its life (`life_batch`: those running now leave, new arrivals join),
       capped at the worker's slots (a full worker runs max_num_seqs sequences, never more),
       stretched by the share of the worker's time its recent placements' prefills take
       (prefill_load.py: the prompts arriving during this request's life share its steps; the
       steps of a slot wait are stretched alike)
(the arithmetic is `CostModel.predict_ttft_s` / `predict_tpot_s`; this module picks the inputs:
which worker's queue, which cache hits, how many tokens cross the link).

Every policy uses these predictions, the baselines only to report them; `GoodputPolicy` decides on
them. The decode side reserves blocks for prompt + max_tokens up front (as the simulator's
workers do): a conservative count, but it keeps the scheduler from overcommitting a worker into
preemption, which would wreck the TPOT of everyone already on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.core.batch_forecast import (
    batch_context,
    life_batch,
    mean_remaining_tokens,
    running_batch,
    slot_wait_s,
    step_stretch,
)
from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.cost_model import CostModel
from scheduler.core.prefill_load import prefill_chunks
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision


@dataclass(frozen=True)
class DisaggregationRule:
    """When a prompt is prefilled on the decode worker itself instead of a prefill worker.

    A short uncached remainder costs less to compute in place than the hop and KV transfer cost,
    and a mostly-cached prompt has its KV on the decode worker already (Dynamo's conditional
    disaggregation makes the same call).
    """

    min_remote_prefill_tokens: int = 256  # fewer uncached tokens than this: prefill locally
    max_cached_fraction: float = 0.75  # at least this fraction already cached there: prefill locally

    def __post_init__(self) -> None:
        if self.min_remote_prefill_tokens < 0 or not 0.0 <= self.max_cached_fraction <= 1.0:
            raise ValueError("need min_remote_prefill_tokens >= 0 and 0 <= max_cached_fraction <= 1")

    def prefill_locally(self, prompt_tokens: int, cached_tokens: int) -> bool:
        uncached = prompt_tokens - cached_tokens
        return (
            uncached < self.min_remote_prefill_tokens
            or cached_tokens >= self.max_cached_fraction * prompt_tokens
        )


# Relative error of a predicted wait behind other work (its length is the remaining work of requests
# whose output lengths are unknown: a uniform remaining life has a CV of ~0.6, a queue of them more)
# and of a predicted compute or step time (the fitted cost models' residual spread, ~0.1-0.35).
WAIT_CV = 1.0
SERVICE_CV = 0.2
_MIN_ERROR_S = 1e-3


def _z(target_s: float, predicted_s: float, error_s: float) -> float:
    return (target_s - predicted_s) / max(error_s, _MIN_ERROR_S)


# Not frozen: built dozens of times per routing decision, where a frozen dataclass costs ~4x as much
# to construct (docs/benchmarks.md, decision latency). Read-only by convention.
@dataclass(slots=True)
class Placement:
    decode: WorkerLoad
    prefill: WorkerLoad | None  # None: prefill locally on the decode worker
    cached_blocks: int  # leading prompt blocks already on the decode worker
    prefill_tokens: int  # tokens computed by whoever prefills
    blocks_needed: int  # new blocks the decode worker must allocate
    ttft_s: float
    tpot_s: float
    # Local prefill only: how much the prompt's compute, spread over the running sequences' remaining
    # tokens, raises the TPOT of the batch already on the decode worker (see `local_interference_s`).
    added_tpot_s: float = 0.0
    # The part of `tpot_s` the worker's prefill share adds (its stretch): it already forecasts prompts
    # arriving at the worker's recent rate, this one among them (see `batch_tpot_s`).
    stretch_tpot_s: float = 0.0
    # The part of `ttft_s` spent waiting behind other work (a decode slot, the prefill queue ahead):
    # predicted from averages of work whose real length is unknown, so far less certain than the rest.
    wait_s: float = 0.0

    @property
    def is_local(self) -> bool:
        return self.prefill is None

    @property
    def fits(self) -> bool:
        return self.blocks_needed <= self.decode.free_blocks

    def tpot_limit_ms(self, request: RequestSummary) -> float:
        """The request's own TPOT target, or a tighter one of a request already on the worker."""
        others = self.decode.tightest_tpot_ms
        return request.slo.tpot_ms if others is None else min(request.slo.tpot_ms, others)

    @property
    def batch_tpot_s(self) -> float:
        """The TPOT the batch on the decode worker should see with this request placed: the stretched
        step, plus whatever of a local prompt's interference the stretch does not already forecast (a
        burst on a quiet worker). Counting both in full queued half of exp1_high_rate's requests on the
        CPU policy runs (pass K, first repeat) while the stretched TPOT alone was within ~10%."""
        return self.tpot_s + max(self.added_tpot_s - self.stretch_tpot_s, 0.0)

    def slack(self, request: RequestSummary) -> float:
        """Smallest relative headroom over the two targets; >= 0 means both are met."""
        ttft_ms = (request.waited_s + self.ttft_s) * 1e3
        ttft_slack = 1.0 - ttft_ms / request.slo.ttft_ms
        tpot_slack = 1.0 - self.batch_tpot_s * 1e3 / self.tpot_limit_ms(request)
        return min(ttft_slack, tpot_slack)

    def meets(self, request: RequestSummary) -> bool:
        return self.fits and self.slack(request) >= 0.0

    def confidence(self, request: RequestSummary) -> float:
        """Headroom over the tighter target in units of that prediction's expected error (a z-score):
        the larger, the likelier both targets are met. Relative slack treats a TTFT that is mostly a
        queue wait as being as sure as a computed one; on the CPU policy runs that sent requests to a
        one-slot worker with ~0.5 slack on TTFT (its median TTFT was predicted well, but its p90 was 1.7x
        the median) instead of a batching worker with ~0.45 slack on a TPOT predicted within ~30%, and the
        misses were all there (docs/benchmarks.md, scheduler policies)."""
        ttft_s = request.waited_s + self.ttft_s
        ttft_error = WAIT_CV * self.wait_s + SERVICE_CV * (self.ttft_s - self.wait_s)
        tpot_s = self.batch_tpot_s
        return min(_z(request.slo.ttft_ms * 1e-3, ttft_s, ttft_error),
                   _z(self.tpot_limit_ms(request) * 1e-3, tpot_s, SERVICE_CV * tpot_s))

    def decision(
        self, request: RequestSummary, kind: DecisionKind, reason: Reason, max_tokens: int | None = None
    ) -> RouteDecision:
        return RouteDecision(
            request_id=request.request_id,
            kind=kind,
            decode_worker_id=self.decode.worker_id,
            prefill_worker_id=None if self.prefill is None else self.prefill.worker_id,
            predicted_ttft_ms=self.ttft_s * 1e3,
            predicted_tpot_ms=self.tpot_s * 1e3,
            predicted_stretch_ms=self.stretch_tpot_s * 1e3,
            reason=reason,
            max_tokens=max_tokens,
            cached_blocks=self.cached_blocks,
        )


def cached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    # The last prompt token is always recomputed: its logits give the first output token.
    return min(cached_blocks * block_size, prompt_tokens - 1)


@dataclass(slots=True)  # not frozen: see Placement
class DecodeSide:
    """The terms of a placement on one decode worker that do not depend on who prefills: computed once
    per (request, decode worker) and shared by every prefill option priced there (`evaluate`)."""

    cost: CostModel
    cached_blocks: int  # leading prompt blocks already on the decode worker
    cached_tokens: int
    running: int  # sequences in its decode batch (`running_batch`)
    running_step_s: float  # one step of that batch; 0 when idle
    stretch: float  # `step_stretch` at the newcomer's step now
    slot_wait_s: float  # stretched
    step_s: float  # the decode step with this request added, unstretched


def decode_side(request: RequestSummary, view: ClusterView, decode: WorkerLoad) -> DecodeSide:
    cost = view.cost(decode.worker_id)
    cached_blocks = view.cached_blocks(decode.worker_id, request.prefix_hashes)
    running = running_batch(decode)
    others = running + request.num_choices - 1  # its sibling choices decode beside it
    others = others if decode.max_num_seqs is None else min(others, decode.max_num_seqs - 1)
    now_step = _tpot_at(cost, decode, request, others)
    stretch = step_stretch(decode, cost, now_step)  # the prompts arriving in its life, at its step now
    step = _tpot_at(cost, decode, request, life_batch(decode, others, request.max_tokens, now_step * stretch))
    return DecodeSide(
        cost=cost,
        cached_blocks=cached_blocks,
        cached_tokens=cached_tokens(request.num_prompt_tokens, cached_blocks, decode.block_size),
        running=running,
        running_step_s=running_step_s(decode, cost),
        stretch=stretch,
        slot_wait_s=slot_wait_s(decode, cost, request.max_tokens) * stretch,
        step_s=step,
    )


@dataclass(slots=True)  # not frozen: see Placement
class PrefillSide:
    """The terms of a remote prefill on one prefill worker that do not depend on the decode worker:
    computed once per (request, prefill worker), when the prefill workers are ranked, and shared by
    every decode worker priced against it."""

    worker: WorkerLoad
    cost: CostModel
    cached_tokens: int  # of the prompt, in the prefill worker's own cache
    backlog_s: float  # its prefill queue ahead of the request
    compute_s: float  # the request's own prefill there

    @property
    def finish_s(self) -> float:
        """When the prefill worker would finish this prompt: its queue, then the uncached part."""
        return self.backlog_s + self.compute_s


def prefill_side(request: RequestSummary, view: ClusterView, prefill: WorkerLoad) -> PrefillSide:
    cost = view.cost(prefill.worker_id)
    prompt = request.num_prompt_tokens
    cached = cached_tokens(prompt, view.cached_blocks(prefill.worker_id, request.prefix_hashes), prefill.block_size)
    return PrefillSide(
        worker=prefill,
        cost=cost,
        cached_tokens=cached,
        backlog_s=cost.prefill_backlog_s(prefill.queued_prefill_tokens, prefill.queued_prefill_requests),
        compute_s=cost.prefill_s(prompt - cached, cached),
    )


def evaluate(
    request: RequestSummary, view: ClusterView, decode: WorkerLoad, prefill: WorkerLoad | None,
    side: DecodeSide | None = None, remote: PrefillSide | None = None,
) -> Placement:
    """`side`: `decode_side(request, view, decode)`, and `remote`: `prefill_side(request, view, prefill)`,
    when the caller has them already (it prices several options with one of them)."""
    if side is None:
        side = decode_side(request, view, decode)
    prompt = request.num_prompt_tokens
    decode_cost = side.cost
    added_tpot = 0.0
    if prefill is None:
        compute_tokens = prompt - side.cached_tokens
        # Sequences waiting for a slot on a `both`/decode worker are also in its prefill queue:
        # their prefills and the decode steps of the slot wait run one after the other on the
        # same engine, so the two add up (no double count).
        backlog = decode_cost.prefill_backlog_s(decode.queued_prefill_tokens, decode.queued_prefill_requests)
        sliced = sliced_prefill_s(decode, side, compute_tokens)
        if sliced is None:
            ttft = side.slot_wait_s + decode_cost.predict_ttft_s(
                queued_tokens=decode.queued_prefill_tokens,
                queued_requests=decode.queued_prefill_requests,
                new_tokens=compute_tokens,
                cached_tokens=side.cached_tokens,
                shared_step_s=decode_cost.mixed_decode_share * side.running_step_s,
            )
        else:
            ttft = side.slot_wait_s + backlog + sliced
        if side.running:
            added_tpot = local_interference_s(
                decode_cost, compute_tokens, side.cached_tokens,
                running_tokens_left(decode, side.running, side.running_step_s, request.max_tokens),
                side.running_step_s)
        wait = side.slot_wait_s + backlog
    else:
        if remote is None:
            remote = prefill_side(request, view, prefill)
        compute_tokens = prompt - remote.cached_tokens
        # Decode-first: the prefill is asked for once the decode side has taken the request on.
        # (A real decode engine takes a remote prefill's KV beyond its slots and then holds back
        # its decode steps instead: the wait lands on the second token rather than the first.)
        # The prefill worker's TTFT: its queue, the prompt's compute, the KV the decode worker lacks
        # crossing the link (`CostModel.predict_ttft_s`, its terms computed once in `remote`).
        ttft = side.slot_wait_s + (remote.finish_s + remote.cost.transfer_s(prompt - side.cached_tokens))
        # The hand-off lands between two of the decode worker's steps: reserving the blocks and
        # committing the KV each wait for a step boundary, about half a step each (measured: the
        # hand-off overhead grows from ~13 to ~30 ms p50 as the decode batch grows, docs/benchmarks.md).
        ttft += side.running_step_s
        wait = side.slot_wait_s + remote.backlog_s
    tpot = side.step_s * side.stretch
    blocks_needed = math.ceil((prompt + request.output_tokens) / decode.block_size) - side.cached_blocks
    return Placement(
        decode, prefill, side.cached_blocks, compute_tokens, max(blocks_needed, 0), ttft, tpot, added_tpot,
        stretch_tpot_s=tpot - side.step_s, wait_s=wait,
    )


def sliced_prefill_s(decode: WorkerLoad, side: DecodeSide, new_tokens: int) -> float | None:
    """A local prompt's own prefill when the worker's engine runs it in several slices beside a decoding
    batch: one slice per step, each step the batch's plus the mean excess the worker's mixed steps
    measured (`FoldedCost.per_step_s`). None when it takes one step, the batch is empty or no mixed step
    was measured: one prefill plus the shared step is the price then (`CostModel.predict_ttft_s`).
    Priced as one prefill (~57 ms), a 2,048-token prompt run as four 512-token slices, each in a ~35-ms
    step, on a busy 1xH200 worker reached its first token 77-91 ms later than predicted at the median
    (docs/benchmarks.md, "Folded prefill cost")."""
    slices = prefill_chunks(new_tokens, decode.snapshot.max_prefill_chunk)
    per_step = decode.folded_s_per_step
    if slices <= 1 or not side.running or per_step is None:
        return None
    return slices * (side.running_step_s + per_step)


def local_interference_s(
    cost: CostModel, new_tokens: int, cached: int, tokens_left: float, running_step_s: float
) -> float:
    """TPOT added to each running sequence when `new_tokens` are prefilled on their decode worker.

    Chunked prefill folds the prompt into the batch's steps, so the running sequences wait once for
    what it adds to their step (`CostModel.prefill_added_s`: the prefill, less the part of the decode
    step that a mixed step does not pay); spread over the `tokens_left` they still have to generate
    (`running_tokens_left`) that is their TPOT rise. The prefill's fixed part counts too: on a CPU the
    fitted prefill cost is nearly all fixed part.
    """
    return cost.prefill_added_s(new_tokens, cached, running_step_s) / max(tokens_left, 1.0)


def running_tokens_left(decode: WorkerLoad, running: int, running_step_s: float, max_tokens: int) -> float:
    """The tokens the running sequences still have to generate, on average: what the worker reported
    (`mean_remaining_tokens`), else half the newcomer's `max_tokens` (the only length known then).

    The newcomer's own length is the wrong divisor when the worker says how long its sequences still
    run: on a default `baton serve` on CPU a 2-token request beside a 200-token stream was priced as
    adding its whole ~0.22-s prefill to every token of that stream (TPOT 0.38 s against a 0.25-s
    target, where the stream's 180 tokens left spread it to ~1 ms), and it waited in the admission
    queue until its TTFT target passed and got a 503 (docs/benchmarks.md, "Admission on a default
    `baton serve`")."""
    reported = mean_remaining_tokens(decode, running, running_step_s) if running_step_s > 0 else None
    return max(max_tokens // 2, 1) if reported is None else reported


def _tpot_at(cost: CostModel, decode: WorkerLoad, request: RequestSummary, others: float) -> float:
    """The decode step with the request beside `others` sequences (a mean: interpolated between the
    whole batches around it), each at the batch's mean context (an empty batch's arrivals: at the
    request's own mid-life context)."""
    prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
    batch = decode.decode_batch
    per_seq = decode.context_tokens / batch if batch > 0 else prompt + max_tokens // 2

    def at(seqs: int) -> float:
        return cost.predict_tpot_s(batch=seqs, context_tokens=round(per_seq * seqs),
                                   prompt_tokens=prompt, max_tokens=max_tokens)

    whole = int(others)
    part = others - whole
    low = at(whole)
    return low if part <= 0.0 else low + part * (at(whole + 1) - low)


def running_step_s(decode: WorkerLoad, cost: CostModel) -> float:
    """One step of the decode batch running on the worker; 0 when idle."""
    running = running_batch(decode)
    return cost.decode_step_s(running, batch_context(decode, running)) if running else 0.0


def prefill_options(
    request: RequestSummary, view: ClusterView, decode: WorkerLoad, rule: DisaggregationRule
) -> list[WorkerLoad | None]:
    """The prefill choices for one decode worker: local only, or every prefill worker."""
    prefill_workers = view.prefill_workers(request.model)
    cached_blocks = view.cached_blocks(decode.worker_id, request.prefix_hashes)
    cached = cached_tokens(request.num_prompt_tokens, cached_blocks, decode.block_size)
    if not prefill_workers or rule.prefill_locally(request.num_prompt_tokens, cached):
        return [None]
    return list(prefill_workers)


def candidate_placements(
    request: RequestSummary, view: ClusterView, rule: DisaggregationRule
) -> list[Placement]:
    return [
        evaluate(request, view, decode, prefill)
        for decode in view.decode_workers(request.model)
        for prefill in prefill_options(request, view, decode, rule)
    ]
