"""Cache affinity traded against load, with one stated exchange rate.

A decode worker's cost is `decode_batch - affinity_weight * cached_fraction`, where
cached_fraction is the share of the request's full prompt blocks the worker already holds. With
the default weight 8, a worker holding the whole prefix keeps winning until it runs 8 more
sequences than the emptiest worker; a half-cached prefix is worth 4. Unlike SGLang's router there
is no mode switch at a threshold: the trade-off is continuous, so load shifts away gradually.
"""

from __future__ import annotations

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.placement import DisaggregationRule, cached_tokens, evaluate, prefill_options
from scheduler.core.policies.base import Policy, reject_no_workers
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision


class PrefixAwarePolicy(Policy):
    name = "prefix_aware"

    def __init__(self, affinity_weight: float = 8.0, rule: DisaggregationRule | None = None) -> None:
        if affinity_weight < 0:
            raise ValueError(f"affinity_weight must be >= 0, got {affinity_weight}")
        self.affinity_weight = affinity_weight  # sequences of load one fully cached prefix is worth
        self._rule = rule or DisaggregationRule()

    def route(self, request: RequestSummary, view: ClusterView, now: float) -> RouteDecision:
        decode_workers = view.decode_workers(request.model)
        if not decode_workers:
            return reject_no_workers(request)
        hashes = request.prefix_hashes

        def decode_key(worker: WorkerLoad) -> tuple[float, int, str]:
            cached = view.cached_blocks(worker.worker_id, hashes)
            fraction = cached / len(hashes) if hashes else 0.0
            return (worker.decode_batch - self.affinity_weight * fraction, -cached, worker.worker_id)

        decode = min(decode_workers, key=decode_key)
        prefill = min(
            prefill_options(request, view, decode, self._rule),
            key=lambda w: self._prefill_key(request, view, w),
        )
        placement = evaluate(request, view, decode, prefill)
        reason = Reason.PREFIX_AFFINITY if placement.cached_blocks else Reason.LEAST_LOADED
        return placement.decision(request, DecisionKind.ROUTE, reason)

    @staticmethod
    def _prefill_key(
        request: RequestSummary, view: ClusterView, worker: WorkerLoad | None
    ) -> tuple[int, str]:
        # Queued tokens ahead versus tokens the worker's own cache saves: both are prefill work.
        if worker is None:
            return (0, "")
        cached_blocks = view.cached_blocks(worker.worker_id, request.prefix_hashes)
        saved = cached_tokens(request.num_prompt_tokens, cached_blocks, worker.block_size)
        return (worker.queued_prefill_tokens - saved, worker.worker_id)
