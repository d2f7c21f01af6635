import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import GoodputPolicy, LeastLoadedPolicy, RoundRobinPolicy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import (
    SLO,
    DecisionKind,
    DecodeSample,
    KVEvent,
    KVEventKind,
    Reason,
    Tier,
    WorkerRole,
)

TIMEOUT_S = 3.0


def scheduler_with(policy, make_snapshot, *worker_ids: str, **snapshot_fields) -> Scheduler:
    scheduler = Scheduler(policy, SchedulerConfig(heartbeat_timeout_s=TIMEOUT_S, dispatch_grace_s=0.05))
    for worker_id in worker_ids:
        scheduler.register(make_snapshot(worker_id, **snapshot_fields), now=0.0)
    return scheduler


def test_a_silent_worker_is_dropped_after_the_deadline_and_never_routed_to(
    make_snapshot, make_request
) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "alive", "silent")
    scheduler.on_heartbeat(make_snapshot("alive"), [], [], now=2.5)
    assert scheduler.live_worker_ids(now=2.9) == ["alive", "silent"]  # within the deadline
    decisions = [scheduler.route(make_request(f"r{i}"), now=3.5) for i in range(6)]
    assert {d.decode_worker_id for d in decisions} == {"alive"}
    assert scheduler.live_worker_ids(now=3.5) == ["alive"]


def test_a_dropped_worker_that_heartbeats_again_is_routable_again(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")
    assert scheduler.route(make_request("r0"), now=10.0).reason == Reason.NO_WORKERS
    scheduler.on_heartbeat(make_snapshot("w"), [], [], now=11.0)
    assert scheduler.route(make_request("r1"), now=11.0).decode_worker_id == "w"


def test_a_dropped_worker_loses_its_prefix_entries(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")
    req = make_request(prompt=256)
    scheduler.on_heartbeat(
        make_snapshot("w"), [], [KVEvent(KVEventKind.STORED, h) for h in req.prefix_hashes], 1.0
    )
    assert scheduler.route(req, now=1.0).cached_blocks == 16
    scheduler.live_worker_ids(now=10.0)  # expired
    scheduler.on_heartbeat(make_snapshot("w"), [], [], now=11.0)
    assert scheduler.route(make_request("r2", prompt=256), now=11.0).cached_blocks == 0


def test_requests_between_heartbeats_do_not_herd_onto_one_worker(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(LeastLoadedPolicy(), make_snapshot, "a", "b", "c")
    decisions = [scheduler.route(make_request(f"r{i}"), now=0.01 * i) for i in range(6)]
    assert [d.decode_worker_id for d in decisions] == ["a", "b", "c", "a", "b", "c"]


def test_a_heartbeat_replaces_the_load_the_scheduler_assumed(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(LeastLoadedPolicy(), make_snapshot, "a", "b")
    assert scheduler.route(make_request("r0"), now=0.0).decode_worker_id == "a"
    # Heartbeats after the grace: "a" reports the request done, "b" reports two running.
    scheduler.on_heartbeat(make_snapshot("a"), [], [], now=1.0)
    scheduler.on_heartbeat(make_snapshot("b", running_seqs=2), [], [], now=1.0)
    assert scheduler.route(make_request("r1"), now=1.0).decode_worker_id == "a"


def test_heartbeat_samples_update_the_workers_cost_model(make_snapshot) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")
    before = scheduler.cost_model("w").decode_step_s(8, 8000)
    samples = [DecodeSample(8, 8000, 0.5) for _ in range(50)]
    scheduler.on_heartbeat(make_snapshot("w"), samples, [], now=1.0)
    assert scheduler.cost_model("w").decode_step_s(8, 8000) > 10 * before


def test_an_unknown_worker_heartbeat_registers_it(make_snapshot, make_request) -> None:
    scheduler = Scheduler(RoundRobinPolicy())
    scheduler.on_heartbeat(make_snapshot("late"), [], [], now=5.0)
    assert scheduler.route(make_request(), now=5.0).decode_worker_id == "late"


def test_a_request_no_worker_could_ever_hold_is_rejected_without_retry(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")  # 1000 blocks of 16 tokens
    decision = scheduler.route(make_request(prompt=15_000, max_tokens=2000), now=0.0)
    assert (decision.kind, decision.reason, decision.retry_after_s) == (
        DecisionKind.REJECT,
        Reason.TOO_LARGE,
        None,
    )


def _full_then_room_for_one(make_snapshot, make_request, scheduler: Scheduler, now: float) -> None:
    # 512 prompt + 64 output tokens = 36 blocks (the prompt's first 32 are not cached anywhere).
    scheduler.on_heartbeat(make_snapshot("w", free_blocks=40), [], [], now=now)


def test_enterprise_is_served_before_free_under_overload(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "w", free_blocks=0)
    slo = SLO(ttft_ms=5000, tpot_ms=100)
    free = scheduler.route(make_request("free", tier=Tier.FREE, slo=slo), now=0.0)
    plus = scheduler.route(make_request("plus", tier=Tier.PLUS, slo=slo), now=0.1)
    enterprise = scheduler.route(make_request("ent", tier=Tier.ENTERPRISE, slo=slo), now=0.2)
    assert [d.kind for d in (free, plus, enterprise)] == [DecisionKind.QUEUE] * 3
    assert scheduler.tick(now=0.3) == []  # still no room
    _full_then_room_for_one(make_snapshot, make_request, scheduler, now=0.4)
    placed = scheduler.tick(now=0.4)
    assert [(d.request_id, d.kind) for d in placed] == [("ent", DecisionKind.ROUTE)]
    _full_then_room_for_one(make_snapshot, make_request, scheduler, now=0.6)
    assert [d.request_id for d in scheduler.tick(now=0.6)] == ["plus"]
    _full_then_room_for_one(make_snapshot, make_request, scheduler, now=0.8)
    assert [d.request_id for d in scheduler.tick(now=0.8)] == ["free"]


def test_a_newcomer_queues_behind_waiting_requests_of_its_tier(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "w", free_blocks=0)
    scheduler.route(make_request("first", tier=Tier.PLUS), now=0.0)
    _full_then_room_for_one(make_snapshot, make_request, scheduler, now=0.1)
    second = scheduler.route(make_request("second", tier=Tier.PLUS), now=0.1)
    assert (second.kind, second.reason) == (DecisionKind.QUEUE, Reason.BEHIND_QUEUE)
    assert [d.request_id for d in scheduler.tick(now=0.1)] == ["first"]


def test_a_queued_request_is_rejected_once_its_wait_runs_out(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "w", free_blocks=0)
    scheduler.route(make_request("r", slo=SLO(ttft_ms=1000, tpot_ms=100)), now=0.0)
    assert scheduler.tick(now=0.9) == []
    [decision] = scheduler.tick(now=1.1)
    assert (decision.kind, decision.reason) == (DecisionKind.REJECT, Reason.QUEUE_TIMEOUT)
    assert decision.retry_after_s is not None
    assert scheduler.queued == 0


def test_on_finished_cancels_a_queued_request(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "w", free_blocks=0)
    scheduler.route(make_request("r"), now=0.0)
    scheduler.on_finished("r", now=0.5)
    _full_then_room_for_one(make_snapshot, make_request, scheduler, now=0.6)
    assert scheduler.tick(now=0.6) == []
    assert scheduler.queued == 0


def test_finished_requests_stop_protecting_their_tpot_target(make_snapshot, make_request) -> None:
    # A 15 ms request on "w" would keep a loaded worker off-limits until it finishes.
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "w")
    scheduler.route(make_request("strict", slo=SLO(ttft_ms=2000, tpot_ms=25)), now=0.0)
    scheduler.on_heartbeat(make_snapshot("w", running_seqs=60), [], [], now=1.0)
    assert scheduler.route(make_request("next"), now=1.0).kind is DecisionKind.QUEUE
    scheduler.on_finished("strict", now=1.1)
    assert scheduler.tick(now=1.1)[0].kind is DecisionKind.ROUTE


def test_conversation_turns_stick_to_the_worker_of_the_previous_turn(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(GoodputPolicy(), make_snapshot, "a", "b", "c")
    first = scheduler.route(make_request("t1", conversation_id="c1"), now=0.0)
    for i in range(3):  # load the cluster evenly so slack alone would not pick the same worker
        scheduler.route(make_request(f"other{i}"), now=0.0)
    second = scheduler.route(make_request("t2", conversation_id="c1"), now=0.1)
    assert second.decode_worker_id == first.decode_worker_id
    assert second.reason == Reason.CONVERSATION_AFFINITY


def test_prefill_workers_are_never_decode_targets(make_snapshot, make_request) -> None:
    scheduler = Scheduler(RoundRobinPolicy())
    scheduler.register(make_snapshot("p", WorkerRole.PREFILL), now=0.0)
    scheduler.register(make_snapshot("d"), now=0.0)
    decisions = [scheduler.route(make_request(f"r{i}", prompt=2048), now=0.0) for i in range(3)]
    assert {(d.decode_worker_id, d.prefill_worker_id) for d in decisions} == {("d", "p")}


def test_a_worker_reported_failed_is_not_routed_to_until_it_heartbeats_again(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "dead", "alive")
    assert scheduler.report_failure("dead", now=0.5)
    decisions = [scheduler.route(make_request(f"r{i}"), now=0.5 + 0.01 * i) for i in range(4)]
    assert {d.decode_worker_id for d in decisions} == {"alive"}  # at once, long before the heartbeat deadline
    assert scheduler.live_worker_ids(now=1.0) == ["alive", "dead"]  # still registered: its heartbeat is known
    assert scheduler.routable_worker_ids(now=1.0) == ["alive"]
    scheduler.on_heartbeat(make_snapshot("dead"), [], [], now=1.2)  # a wrong report costs one heartbeat, no more
    assert scheduler.routable_worker_ids(now=1.2) == ["alive", "dead"]
    assert {scheduler.route(make_request(f"s{i}"), now=1.3).decode_worker_id for i in range(2)} == {"alive", "dead"}


def test_a_failure_report_on_an_unknown_or_expired_worker_changes_nothing(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")
    assert not scheduler.report_failure("never-registered", now=0.5)
    assert not scheduler.report_failure("w", now=TIMEOUT_S + 1)  # expired already
    scheduler.register(make_snapshot("w"), now=TIMEOUT_S + 2)  # a restart is a heartbeat: not failed
    assert scheduler.route(make_request("r"), now=TIMEOUT_S + 2).decode_worker_id == "w"


def test_when_the_only_worker_is_reported_failed_requests_find_no_worker(make_snapshot, make_request) -> None:
    scheduler = scheduler_with(RoundRobinPolicy(), make_snapshot, "w")
    scheduler.report_failure("w", now=0.1)
    assert scheduler.route(make_request("r"), now=0.2).reason == Reason.NO_WORKERS


# An H100-like prefill line with its attention term: a backlog priced as one lumped prompt costs the
# square of the whole queue's length.
_H100_LIKE = WorkerProfile(
    prefill_fixed_s=4e-3, prefill_per_token_s=1.6e-5, prefill_per_token_sq_s=3.2e-9, prefill_floor_s=0.016,
    decode_fixed_s=6.7e-3, decode_per_seq_s=1e-5, decode_per_context_token_s=4.3e-8,
    transfer_fixed_s=0.011, transfer_per_token_s=2e-6,
)


def test_a_prefill_workers_backlog_is_priced_per_prompt_it_reports(make_snapshot, make_request) -> None:
    """A chunked prefill worker computes four 2k prompts at once and has one more waiting: 10,240 tokens,
    but only 1 not started (`queue_depth`). Priced as one 10k-token prompt, the remote TTFT passed the
    500 ms target and the prompt went to the decode worker, into its 24-sequence batch (on 4xH100 the
    scheduler did that to 13% of the prompts at 24 req/s, and the batch's TPOT p90 rose past 20 ms).
    With the prompt count the worker reports, the same backlog is five 2k prompts: remote, on time."""
    def route_with(reported_prompts: int):
        scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(heartbeat_timeout_s=TIMEOUT_S, dispatch_grace_s=0.05,
                                                                default_profile=_H100_LIKE))
        scheduler.register(make_snapshot("d", running_seqs=24, running_context_tokens=24 * 2100), now=0.0)
        scheduler.register(make_snapshot("p", WorkerRole.PREFILL, queue_depth=1, running_seqs=4,
                                         inflight_prefill_tokens=10_240,
                                         inflight_prefill_requests=reported_prompts), now=0.0)
        return scheduler.route(make_request("r", prompt=2048, slo=SLO(500, 20)), now=0.0)

    lumped, counted = route_with(0), route_with(5)  # 0: an older worker that does not say
    assert (lumped.prefill_worker_id, lumped.prefill_reason) == (None, "prefill_fleet_busy")
    assert (counted.prefill_worker_id, counted.prefill_reason) == ("p", "remote_cheaper")
    assert counted.predicted_ttft_ms < 500


def test_a_worker_that_has_not_decoded_yet_is_priced_by_its_models_other_workers(make_snapshot, make_request) -> None:
    """CPU workers start from the default (GPU-like) profile, whose decode step is ~5x too fast: a worker
    with no samples yet looked nearly free, and a one-slot worker got requests queued behind its running
    one at a predicted TTFT of ~0.2 s that took ~2 s. Its peers' steps (same model) now stand in."""
    scheduler = Scheduler(GoodputPolicy(), SchedulerConfig(heartbeat_timeout_s=TIMEOUT_S))
    for worker_id, model in (("seasoned", "m"), ("fresh", "m"), ("other", "other-model")):
        scheduler.register(make_snapshot(worker_id, model=model), now=0.0)
    steps = [DecodeSample(batch_size=1, context_tokens=100, seconds=0.08)] * 20
    scheduler.on_heartbeat(make_snapshot("seasoned"), steps, [], now=0.5)
    assert scheduler.cost_model("fresh").decode_step_s(1, 100) == pytest.approx(0.08, rel=0.05)
    assert scheduler.cost_model("other").decode_step_s(1, 100) < 0.02  # another model's steps say nothing
