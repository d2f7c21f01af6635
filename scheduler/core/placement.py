"""Predicting what a request would see on a (decode worker, prefill worker or local) pair.

TTFT = prefill queue ahead + own prefill (+ the decode step it shares when prefilled locally)
       + KV transfer of the blocks the decode worker lacks (remote prefill only)
TPOT = decode step time with this request added, at its mid-life context length
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

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.types import DecisionKind, RequestSummary, RouteDecision


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


@dataclass(frozen=True)
class Placement:
    decode: WorkerLoad
    prefill: WorkerLoad | None  # None: prefill locally on the decode worker
    cached_blocks: int  # leading prompt blocks already on the decode worker
    prefill_tokens: int  # tokens computed by whoever prefills
    blocks_needed: int  # new blocks the decode worker must allocate
    ttft_s: float
    tpot_s: float

    @property
    def fits(self) -> bool:
        return self.blocks_needed <= self.decode.free_blocks

    def tpot_limit_ms(self, request: RequestSummary) -> float:
        """The request's own TPOT target, or a tighter one of a request already on the worker."""
        others = self.decode.tightest_tpot_ms
        return request.slo.tpot_ms if others is None else min(request.slo.tpot_ms, others)

    def slack(self, request: RequestSummary) -> float:
        """Smallest relative headroom over the two targets; >= 0 means both are met."""
        ttft_ms = (request.waited_s + self.ttft_s) * 1e3
        ttft_slack = 1.0 - ttft_ms / request.slo.ttft_ms
        tpot_slack = 1.0 - self.tpot_s * 1e3 / self.tpot_limit_ms(request)
        return min(ttft_slack, tpot_slack)

    def meets(self, request: RequestSummary) -> bool:
        return self.fits and self.slack(request) >= 0.0

    def decision(
        self, request: RequestSummary, kind: DecisionKind, reason: str, max_tokens: int | None = None
    ) -> RouteDecision:
        return RouteDecision(
            request_id=request.request_id,
            kind=kind,
            decode_worker_id=self.decode.worker_id,
            prefill_worker_id=None if self.prefill is None else self.prefill.worker_id,
            predicted_ttft_ms=self.ttft_s * 1e3,
            predicted_tpot_ms=self.tpot_s * 1e3,
            reason=reason,
            max_tokens=max_tokens,
            cached_blocks=self.cached_blocks,
        )


def cached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    # The last prompt token is always recomputed: its logits give the first output token.
    return min(cached_blocks * block_size, prompt_tokens - 1)


def evaluate(
    request: RequestSummary, view: ClusterView, decode: WorkerLoad, prefill: WorkerLoad | None
) -> Placement:
    prompt = request.num_prompt_tokens
    decode_cost = view.cost(decode.worker_id)
    cached_blocks = view.cached_blocks(decode.worker_id, request.prefix_hashes)
    decode_cached = cached_tokens(prompt, cached_blocks, decode.block_size)
    if prefill is None:
        shared_step = (
            decode_cost.decode_step_s(decode.decode_batch, decode.context_tokens)
            if decode.decode_batch
            else 0.0
        )
        compute_tokens = prompt - decode_cached
        ttft = decode_cost.predict_ttft_s(
            queued_tokens=decode.queued_prefill_tokens,
            queued_requests=decode.queued_prefill_requests,
            new_tokens=compute_tokens,
            cached_tokens=decode_cached,
            shared_step_s=shared_step,
        )
    else:
        prefill_blocks = view.cached_blocks(prefill.worker_id, request.prefix_hashes)
        prefill_cached = cached_tokens(prompt, prefill_blocks, prefill.block_size)
        compute_tokens = prompt - prefill_cached
        ttft = view.cost(prefill.worker_id).predict_ttft_s(
            queued_tokens=prefill.queued_prefill_tokens,
            queued_requests=prefill.queued_prefill_requests,
            new_tokens=compute_tokens,
            cached_tokens=prefill_cached,
            transfer_tokens=prompt - decode_cached,
        )
    tpot = decode_cost.predict_tpot_s(
        batch=decode.decode_batch,
        context_tokens=decode.context_tokens,
        prompt_tokens=prompt,
        max_tokens=request.max_tokens,
    )
    blocks_needed = math.ceil((prompt + request.max_tokens) / decode.block_size) - cached_blocks
    return Placement(decode, prefill, cached_blocks, compute_tokens, max(blocks_needed, 0), ttft, tpot)


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
