"""Degraded mode with a smaller model: the real scheduler core (goodput policy, cost models, registry)
over a saturated fleet of the asked model and an idle fleet of its fallback.

The big model's worker reports a prefill backlog the cost model prices at ~5 s against a 2 s TTFT
target, so no placement on it meets the SLO; an idle worker of the fallback model meets it.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.core.policies import GoodputConfig, GoodputPolicy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import SLO, DecisionKind, Reason, RequestSummary, Tier, WorkerRole
from tests.unit.scheduler.conftest import FAST, request, snapshot

BACKLOG_TOKENS = 100_000  # FAST prefills 5e-5 s a token: ~5 s of queued prompts


def _scheduler(config: GoodputConfig, *, small_backlog: int = 0) -> Scheduler:
    scheduler = Scheduler(GoodputPolicy(config), SchedulerConfig(heartbeat_timeout_s=30.0))
    fleet = [
        snapshot("big-0", WorkerRole.BOTH, model="big", inflight_prefill_tokens=BACKLOG_TOKENS, queue_depth=40),
        snapshot("big-1", WorkerRole.BOTH, model="big", inflight_prefill_tokens=BACKLOG_TOKENS, queue_depth=40),
        snapshot("small-0", WorkerRole.BOTH, model="small", inflight_prefill_tokens=small_backlog),
    ]
    for worker in fleet:
        scheduler.register(worker, now=0.0, profile=FAST)
    return scheduler


def _asking(model: str, tier: Tier = Tier.FREE, request_id: str = "r1") -> RequestSummary:
    return replace(request(request_id, prompt=512, tier=tier, slo=SLO(2000, 100)), model=model)


def test_overloaded_free_requests_are_served_whole_by_the_smaller_model() -> None:
    scheduler = _scheduler(GoodputConfig(degrade_models={"big": "small"}))
    decision = scheduler.route(_asking("big"), now=0.0)
    assert (decision.kind, decision.reason, decision.model) == (
        DecisionKind.DEGRADE, Reason.DEGRADED_MODEL, "small")
    assert decision.decode_worker_id == "small-0"
    assert decision.max_tokens is None  # the answer keeps its asked length
    assert decision.predicted_ttft_ms is not None and decision.predicted_ttft_ms < 2000


def test_without_a_fallback_or_for_enterprise_the_request_waits_for_its_own_model() -> None:
    assert _scheduler(GoodputConfig()).route(_asking("big"), now=0.0).kind is DecisionKind.QUEUE
    degrading = _scheduler(GoodputConfig(degrade_models={"big": "small"}))
    assert degrading.route(_asking("big", Tier.ENTERPRISE), now=0.0).kind is DecisionKind.QUEUE


def test_requests_for_the_fallback_itself_route_normally_and_the_big_fleet_is_never_used_for_them() -> None:
    scheduler = _scheduler(GoodputConfig(degrade_models={"big": "small"}))
    decision = scheduler.route(_asking("small"), now=0.0)
    assert (decision.kind, decision.decode_worker_id, decision.model) == (DecisionKind.ROUTE, "small-0", "")


def test_a_saturated_fallback_leaves_the_request_queued() -> None:
    both_busy = _scheduler(GoodputConfig(degrade_models={"big": "small"}), small_backlog=BACKLOG_TOKENS)
    assert both_busy.route(_asking("big"), now=0.0).kind is DecisionKind.QUEUE


def test_the_smaller_model_is_tried_before_a_shorter_max_tokens() -> None:
    # A full KV pool on the big model: half the tokens would fit there, yet the fallback serves it whole.
    scheduler = Scheduler(GoodputPolicy(GoodputConfig(degrade_fraction=0.5, degrade_models={"big": "small"})))
    scheduler.register(snapshot("big-0", model="big", free_blocks=70), now=0.0, profile=FAST)
    tight = replace(_asking("big"), max_tokens=1024, prefix_hashes=())
    alone = scheduler.route(tight, now=0.0)  # no fallback worker yet: the shorter answer
    assert (alone.kind, alone.reason, alone.model, alone.max_tokens) == (DecisionKind.DEGRADE, Reason.DEGRADED, "", 512)
    scheduler.register(snapshot("small-0", model="small"), now=0.0, profile=FAST)
    decision = scheduler.route(replace(tight, request_id="r2"), now=0.0)
    assert (decision.kind, decision.model, decision.max_tokens) == (DecisionKind.DEGRADE, "small", None)


def test_a_degraded_placement_is_charged_to_the_fallback_worker() -> None:
    scheduler = _scheduler(GoodputConfig(degrade_models={"big": "small"}))
    first = scheduler.route(_asking("big", request_id="a"), now=0.0)
    second = scheduler.route(_asking("small", request_id="b"), now=0.0)
    assert first.decode_worker_id == second.decode_worker_id == "small-0"
    # The second placement saw the first one's reservation: one more sequence in the batch.
    assert second.predicted_tpot_ms is not None and first.predicted_tpot_ms is not None
    assert second.predicted_tpot_ms > first.predicted_tpot_ms
