"""Baseline: the decode worker with the fewest sequences (with a free batch slot first), the prefill
worker with the least queued."""

from __future__ import annotations

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.placement import DisaggregationRule, evaluate, prefill_options
from scheduler.core.policies.base import Policy, reject_no_workers
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def __init__(self, rule: DisaggregationRule | None = None) -> None:
        self._rule = rule or DisaggregationRule()

    def route(self, request: RequestSummary, view: ClusterView, now: float) -> RouteDecision:
        decode_workers = view.decode_workers(request.model)
        if not decode_workers:
            return reject_no_workers(request)
        # A worker with a free batch slot beats one where the request would wait for a slot (1 running
        # on 1 slot is busier than 3 on 8); then fewest sequences, then more free KV, then the lower
        # id (reproducible).
        decode = min(
            decode_workers, key=lambda w: (w.slot_queue, w.decode_batch, -w.free_blocks, w.worker_id)
        )
        options = prefill_options(request, view, decode, self._rule)
        prefill = min(options, key=_prefill_key)
        placement = evaluate(request, view, decode, prefill)
        return placement.decision(request, DecisionKind.ROUTE, Reason.LEAST_LOADED)


def _prefill_key(worker: WorkerLoad | None) -> tuple[int, str]:
    return (0, "") if worker is None else (worker.queued_prefill_tokens, worker.worker_id)
