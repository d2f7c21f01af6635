"""Baseline: decode workers (and prefill workers) in turn, blind to load and cache."""

from __future__ import annotations

from scheduler.core.cluster_view import ClusterView
from scheduler.core.placement import DisaggregationRule, evaluate, prefill_options
from scheduler.core.policies.base import Policy, reject_no_workers
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, rule: DisaggregationRule | None = None) -> None:
        self._rule = rule or DisaggregationRule()
        self._next_decode = 0
        self._next_prefill = 0

    def route(self, request: RequestSummary, view: ClusterView, now: float) -> RouteDecision:
        decode_workers = view.decode_workers(request.model)
        if not decode_workers:
            return reject_no_workers(request)
        # A cursor modulo the current list: when workers join or leave, rotation simply continues.
        decode = decode_workers[self._next_decode % len(decode_workers)]
        self._next_decode += 1
        options = prefill_options(request, view, decode, self._rule)
        prefill = options[self._next_prefill % len(options)]
        if prefill is not None:
            self._next_prefill += 1
        placement = evaluate(request, view, decode, prefill)
        return placement.decision(request, DecisionKind.ROUTE, Reason.ROUND_ROBIN)
