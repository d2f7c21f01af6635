"""The contract every routing policy keeps, and the decisions they share.

A policy is an object with one method, `route(request, view, now) -> RouteDecision`. What a caller
may rely on:
- it never reads a clock, sleeps or does I/O: `now` is the only time it knows, so the service and
  the replay simulator get identical decisions from identical inputs;
- it never mutates the view; it may keep small state of its own (a round-robin cursor), which is
  why the scheduler owns exactly one policy instance and calls it from one thread;
- a placed decision (ROUTE/DEGRADE) names a decode worker taken from `view.decode_workers` and,
  if any, a prefill worker from `view.prefill_workers`, for the request's model;
- with no decode worker for the model it answers REJECT with `Reason.NO_WORKERS`.
New routing ideas are new policy classes, not flags on an existing one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from mypy_extensions import mypyc_attr

from scheduler.core.cluster_view import ClusterView
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision

# A worker that registers usually does so within a few heartbeats; retrying sooner just spins.
NO_WORKERS_RETRY_AFTER_S = 5.0


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (scheduler/native.py), still open to new policies
class Policy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def route(self, request: RequestSummary, view: ClusterView, now: float) -> RouteDecision:
        """Place, queue, degrade or reject `request` given the cluster as `view` shows it at `now`."""


def reject(request: RequestSummary, reason: Reason, retry_after_s: float | None) -> RouteDecision:
    return RouteDecision(
        request_id=request.request_id, kind=DecisionKind.REJECT, reason=reason, retry_after_s=retry_after_s
    )


def reject_no_workers(request: RequestSummary) -> RouteDecision:
    return reject(request, Reason.NO_WORKERS, NO_WORKERS_RETRY_AFTER_S)
