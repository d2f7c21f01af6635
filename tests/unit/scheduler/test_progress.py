"""Serving when the hardware can: a short request beside a long stream, a request whose admission wait ran
out, and the Retry-After of a refusal (scheduler/core/progress.py, placement.local_interference_s)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import GoodputPolicy
from scheduler.core.progress import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, capacity_eta_s, first_finish_s
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import SLO, DecisionKind, Reason, Tier

# Step times as measured on a default `baton serve` on the 2-core CPU sandbox: a ~0.2-s prefill that is
# nearly all fixed cost, a ~0.16-s decode step for one or two sequences.
CPU = WorkerProfile(prefill_fixed_s=0.2, prefill_per_token_s=4e-4, prefill_per_token_sq_s=0.0,
                    decode_fixed_s=0.15, decode_per_seq_s=0.005, decode_per_context_token_s=0.0)
ENTERPRISE = SLO(ttft_ms=5000, tpot_ms=250)


def test_a_two_token_request_beside_a_long_stream_is_placed_at_once(make_request, make_load, make_view) -> None:
    """The stream's 180 remaining tokens take the newcomer's prefill (~1 ms a token), not the newcomer's
    own 2 tokens (0.2 s a token: 0.36 s TPOT against 250 ms, which queued it until a 503)."""
    stream = make_load("w", batch=1, tightest_tpot_ms=250.0, context_tokens=60)
    stream = replace(stream, snapshot=replace(stream.snapshot, running_remaining_tokens=180))
    request = make_request("short", prompt=42, tier=Tier.ENTERPRISE, slo=ENTERPRISE, max_tokens=2)
    decision = GoodputPolicy().route(request, make_view([stream], {"w": CPU}), now=0.0)
    assert (decision.kind, decision.decode_worker_id) == (DecisionKind.ROUTE, "w")


def test_without_reported_remaining_tokens_the_newcomers_length_is_the_guess(make_request, make_load,
                                                                            make_view) -> None:
    stream = make_load("w", batch=1, tightest_tpot_ms=250.0, context_tokens=60)  # reports no remaining tokens
    request = make_request("short", prompt=42, tier=Tier.ENTERPRISE, slo=ENTERPRISE, max_tokens=2)
    decision = GoodputPolicy().route(request, make_view([stream], {"w": CPU}), now=0.0)
    assert (decision.kind, decision.reason) == (DecisionKind.QUEUE, Reason.OVERLOADED)


def _busy_scheduler(make_snapshot, free_blocks: int = 1000) -> Scheduler:
    """One decode worker whose 8 sequences decode at ~0.47 s a step, where an idle one takes ~0.19 s: a
    TPOT target of 250 ms is met on an idle worker, and by nobody there now."""
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(default_profile=replace(CPU, decode_per_seq_s=0.04)))
    scheduler.register(make_snapshot("w", running_seqs=8, free_blocks=free_blocks, max_num_seqs=64,
                                     running_remaining_tokens=800), now=0.0)
    return scheduler


@pytest.mark.parametrize("tier", [Tier.ENTERPRISE, Tier.FREE])
def test_a_request_whose_wait_ran_out_is_served_where_a_worker_can_make_progress(make_snapshot, make_request,
                                                                                 tier) -> None:
    scheduler = _busy_scheduler(make_snapshot)
    request = make_request("r", prompt=64, tier=tier, slo=SLO(ttft_ms=1000, tpot_ms=250))
    assert scheduler.route(request, now=0.0).kind is DecisionKind.QUEUE
    assert scheduler.tick(now=0.5) == []
    [decision] = scheduler.tick(now=1.1)
    assert (decision.kind, decision.reason, decision.decode_worker_id) == (
        DecisionKind.ROUTE, Reason.SERVED_PAST_TARGETS, "w")
    assert scheduler.worker_loads(now=1.1)[0].decode_batch == 9  # charged like any placement


def test_a_lighter_tier_is_not_served_past_a_running_target_still_met(make_snapshot, make_request) -> None:
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(default_profile=replace(CPU, decode_per_seq_s=0.04)))
    scheduler.register(make_snapshot("w", running_seqs=0, max_num_seqs=64), now=0.0)
    first = scheduler.route(make_request("ent", prompt=64, tier=Tier.ENTERPRISE, slo=ENTERPRISE), now=0.0)
    assert first.kind is DecisionKind.ROUTE  # decoding at ~0.19-0.23 s a step: its 250-ms target is met
    # A 1,000-token prompt's ~0.6-s prefill spread over 2 tokens would take that stream past its target.
    free = make_request("free", prompt=1000, tier=Tier.FREE, slo=SLO(ttft_ms=1500, tpot_ms=250), max_tokens=4)
    assert scheduler.route(free, now=0.0).kind is DecisionKind.QUEUE
    [decision] = scheduler.tick(now=1.6)
    assert (decision.kind, decision.reason) == (DecisionKind.REJECT, Reason.QUEUE_TIMEOUT)


def test_enterprise_is_served_past_a_running_target_still_met(make_snapshot, make_request) -> None:
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(default_profile=replace(CPU, decode_per_seq_s=0.04)))
    scheduler.register(make_snapshot("w", running_seqs=0, max_num_seqs=64), now=0.0)
    scheduler.route(make_request("ent", prompt=64, tier=Tier.ENTERPRISE, slo=ENTERPRISE), now=0.0)
    late = make_request("late", prompt=1000, tier=Tier.ENTERPRISE, slo=SLO(ttft_ms=1500, tpot_ms=250), max_tokens=4)
    assert scheduler.route(late, now=0.0).kind is DecisionKind.QUEUE
    [decision] = scheduler.tick(now=1.6)
    assert (decision.kind, decision.reason) == (DecisionKind.ROUTE, Reason.SERVED_PAST_TARGETS)


def test_a_refusal_says_when_the_first_running_sequence_is_forecast_to_finish(make_snapshot, make_request) -> None:
    scheduler = _busy_scheduler(make_snapshot, free_blocks=0)  # no KV room: nothing can make progress
    request = make_request("r", prompt=64, tier=Tier.ENTERPRISE, slo=SLO(ttft_ms=1000, tpot_ms=250))
    assert scheduler.route(request, now=0.0).kind is DecisionKind.QUEUE
    [decision] = scheduler.tick(now=1.1)
    assert (decision.kind, decision.reason) == (DecisionKind.REJECT, Reason.QUEUE_TIMEOUT)
    # 8 sequences with 100 tokens left on average: the first ends after ~2 * 100 / 9 steps of ~0.47 s.
    assert decision.retry_after_s == pytest.approx(2 * 100 / 9 * 0.47, rel=0.1)


def test_retry_after_stays_within_its_bounds(make_request, make_load, make_view) -> None:
    request = make_request("r")
    idle = make_load("w")
    assert first_finish_s(idle, make_view([idle]), 64) == 0.0
    assert capacity_eta_s(request, make_view([idle])) == MIN_RETRY_AFTER_S
    assert capacity_eta_s(request, make_view([])) == MAX_RETRY_AFTER_S


def test_the_choices_of_one_prompt_are_placed_and_charged_together(make_snapshot, make_request) -> None:
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(default_profile=CPU))
    scheduler.register(make_snapshot("w", max_num_seqs=64, free_blocks=1000, total_blocks=1000), now=0.0)
    pair = replace(make_request("pair", prompt=64, tier=Tier.FREE, slo=SLO(ttft_ms=5000, tpot_ms=1000),
                                max_tokens=64), num_choices=3)
    decision = scheduler.route(pair, now=0.0)
    assert (decision.kind, decision.decode_worker_id) == (DecisionKind.ROUTE, "w")
    [load] = scheduler.worker_loads(now=0.0)
    assert load.decode_batch == 3  # three sequences decode
    assert load.free_blocks == 1000 - (64 + 3 * 64) // 16  # one prompt, three answers


def test_choices_that_could_never_fit_together_are_refused_as_too_large(make_snapshot, make_request) -> None:
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(default_profile=CPU))
    scheduler.register(make_snapshot("w", free_blocks=20, total_blocks=20), now=0.0)  # 320 tokens
    one = make_request("one", prompt=64, max_tokens=200)
    assert scheduler.route(one, now=0.0).is_placed
    scheduler.on_finished("one", now=0.0)
    decision = scheduler.route(replace(one, request_id="two", num_choices=2), now=0.0)
    assert (decision.kind, decision.reason) == (DecisionKind.REJECT, Reason.TOO_LARGE)
