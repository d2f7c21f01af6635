"""What to do with a request whose admission wait ran out: serve it slowly where a worker can make
progress, and otherwise tell the caller when capacity is expected back.

The admission queue holds a request while no placement meets its targets, so that capacity freed by
the running requests goes to it in tier order. When its wait runs out (its TTFT target has passed,
or its tier's longest wait), refusing it helps nobody any more: its TTFT is lost either way, and a
503 turns a slow answer into none. On a default `baton serve` on a shared 2-core CPU a decode step of
~7 sequences takes ~0.35-0.5 s, over the enterprise tier's 250-ms TPOT target, so every stream past
the sixth was refused after 5 s of waiting although the worker had free slots and KV blocks
(docs/benchmarks.md, "Admission on a default `baton serve`"). So a worker "can make progress" when it
has a free decode slot and KV room for the whole request: the request starts decoding at once there,
only slower than its targets. A tier that must not hold back heavier ones (free, plus) is served so
only where it breaks no running request's TPOT target that is still being met; the enterprise tier
is served wherever a worker can make progress. Otherwise it is refused, with a Retry-After forecast
from the running sequences' remaining lengths.
"""

from __future__ import annotations

from scheduler.core.batch_forecast import mean_remaining_tokens, running_batch
from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.placement import DisaggregationRule, Placement, candidate_placements, running_step_s
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision

# Retry hints are kept within these bounds: under a second a client only spins, and beyond half a
# minute a forecast from the current batch says little (new arrivals change it).
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 30.0


def progress_decision(
    request: RequestSummary, view: ClusterView, may_break_targets: bool, rule: DisaggregationRule | None = None
) -> tuple[RouteDecision, Placement] | None:
    """A placement where the request starts decoding now, its own targets aside: a decode worker with
    a free slot and KV room for prompt + max_tokens, the one predicted to finish it soonest. Unless
    `may_break_targets`, only where it would not push the running requests past a TPOT target they
    meet now (`breaks_running_targets`). None when no worker qualifies."""
    candidates = [
        p for p in candidate_placements(request, view, rule or DisaggregationRule())
        if p.fits and _free_slots(p.decode, request.num_choices)
        and (may_break_targets or not breaks_running_targets(p, view))
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda p: p.ttft_s + p.tpot_s * request.max_tokens)
    return best.decision(request, DecisionKind.ROUTE, Reason.SERVED_PAST_TARGETS), best


def _free_slots(decode: WorkerLoad, wanted: int) -> bool:
    """Whether `wanted` sequences can start decoding on the worker now (unknown slots: unlimited)."""
    slots = decode.max_num_seqs
    return slots is None or decode.decode_batch + wanted <= slots


def breaks_running_targets(placement: Placement, view: ClusterView) -> bool:
    """Whether the placement pushes the requests decoding on its worker past the tightest TPOT target
    among them while their batch, without it, is forecast to meet that target. A batch already past
    its target is not protected by refusing one more request: the refusal only turns a slow answer
    into none (on a shared 2-core CPU, 16 streams decode at ~0.5 s a step whatever the 17th does)."""
    tightest_ms = placement.decode.tightest_tpot_ms
    if tightest_ms is None or placement.batch_tpot_s * 1e3 <= tightest_ms:
        return False
    decode = placement.decode
    return running_step_s(decode, view.cost(decode.worker_id)) * 1e3 <= tightest_ms


def capacity_eta_s(request: RequestSummary, view: ClusterView) -> float:
    """When a worker serving the request's model is forecast to free a decode slot and the KV blocks
    of one sequence: the soonest, over the workers, of the first of its running sequences to finish
    (`first_finish_s`), within [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
    etas = [first_finish_s(decode, view, request.max_tokens) for decode in view.decode_workers(request.model)]
    if not etas:
        return MAX_RETRY_AFTER_S
    return min(max(min(etas), MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


def first_finish_s(decode: WorkerLoad, view: ClusterView, max_tokens: int) -> float:
    """Seconds until the first of the worker's running sequences finishes: their remaining lengths
    spread evenly over (0, 2m] (as for slot waits, batch_forecast.py), the first of n ends after
    2m / (n + 1) steps of the batch's step; m is what the worker reported, else half `max_tokens`.
    0 when nothing runs (capacity is there now: only the request's own size was in the way)."""
    running = running_batch(decode)
    if running <= 0:
        return 0.0
    step_s = running_step_s(decode, view.cost(decode.worker_id))
    mean = mean_remaining_tokens(decode, running, step_s) if step_s > 0 else None
    remaining = max_tokens / 2 if mean is None else mean
    return 2 * remaining / (running + 1) * step_s
