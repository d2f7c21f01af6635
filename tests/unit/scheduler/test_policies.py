from dataclasses import replace

import pytest

from scheduler.core.placement import DisaggregationRule, evaluate
from scheduler.core.policies import (
    GoodputConfig,
    GoodputPolicy,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
)
from scheduler.types import SLO, DecisionKind, Reason, Tier, WorkerRole, WorkerSnapshot
from tests.unit.scheduler.conftest import snapshot

PREFILL = WorkerRole.PREFILL


def test_round_robin_rotates_decode_and_prefill_workers(make_request, make_load, make_view) -> None:
    loads = [
        make_load("d0"),
        make_load("d1"),
        make_load("d2"),
        make_load("p0", PREFILL),
        make_load("p1", PREFILL),
    ]
    policy = RoundRobinPolicy()
    decisions = [policy.route(make_request(f"r{i}", prompt=2048), make_view(loads), 0.0) for i in range(4)]
    assert [d.decode_worker_id for d in decisions] == ["d0", "d1", "d2", "d0"]
    assert [d.prefill_worker_id for d in decisions] == ["p0", "p1", "p0", "p1"]


def test_least_loaded_picks_the_emptiest_decode_and_prefill_worker(
    make_request, make_load, make_view
) -> None:
    loads = [
        make_load("d0", batch=5),
        make_load("d1", batch=2),
        make_load("d2", batch=7),
        make_load("p0", PREFILL, queued_prefill_tokens=9000),
        make_load("p1", PREFILL, queued_prefill_tokens=100),
    ]
    decision = LeastLoadedPolicy().route(make_request(prompt=2048), make_view(loads), 0.0)
    assert (decision.decode_worker_id, decision.prefill_worker_id) == ("d1", "p1")
    assert decision.reason == Reason.LEAST_LOADED


@pytest.mark.parametrize(("gap", "expected"), [(0, "holder"), (7, "holder"), (9, "other")])
def test_prefix_aware_prefers_the_holder_until_the_load_gap_exceeds_the_weight(
    make_request, make_load, make_view, gap, expected
) -> None:
    req = make_request(prompt=1024)  # 64 full blocks
    loads = [make_load("holder", batch=gap), make_load("other", batch=0)]
    view = make_view(loads, cached={"holder": req.prefix_hashes})
    decision = PrefixAwarePolicy(affinity_weight=8.0).route(req, view, 0.0)
    assert decision.decode_worker_id == expected


def test_prefix_aware_weighs_a_half_cached_prefix_at_half_the_weight(
    make_request, make_load, make_view
) -> None:
    req = make_request(prompt=1024)
    half = req.prefix_hashes[:32]
    view = make_view([make_load("holder", batch=5), make_load("other")], cached={"holder": half})
    assert PrefixAwarePolicy(affinity_weight=8.0).route(req, view, 0.0).decode_worker_id == "other"
    view = make_view([make_load("holder", batch=3), make_load("other")], cached={"holder": half})
    decision = PrefixAwarePolicy(affinity_weight=8.0).route(req, view, 0.0)
    assert (decision.decode_worker_id, decision.cached_blocks) == ("holder", 32)


def test_goodput_prefers_the_fast_worker_over_an_idle_slow_one(
    make_request, make_load, make_view, fast_profile, slow_profile
) -> None:
    loads = [make_load("fast", batch=20), make_load("slow", batch=0)]
    view = make_view(loads, profiles={"fast": fast_profile, "slow": slow_profile})
    decision = GoodputPolicy().route(make_request(prompt=128), view, 0.0)
    assert decision.kind is DecisionKind.ROUTE
    assert decision.decode_worker_id == "fast"
    assert decision.reason == Reason.MAX_SLACK
    assert decision.predicted_ttft_ms is not None and decision.predicted_tpot_ms is not None


def test_goodput_spreads_load_once_the_busy_worker_has_less_slack(make_request, make_load, make_view) -> None:
    loads = [make_load("busy", batch=200), make_load("idle", batch=0)]
    assert GoodputPolicy().route(make_request(), make_view(loads), 0.0).decode_worker_id == "idle"


def _overloaded_view(make_load, make_view):
    # 40k tokens queued on the only prefill path: ~2 s of prefill before this request starts.
    loads = [make_load("d0", queued_prefill_tokens=40_000, queued_prefill_requests=10)]
    return make_view(loads)


def test_goodput_queues_when_no_placement_meets_the_slo(make_request, make_load, make_view) -> None:
    req = make_request(prompt=128, slo=SLO(ttft_ms=500, tpot_ms=100))
    decision = GoodputPolicy().route(req, _overloaded_view(make_load, make_view), 0.0)
    assert decision.kind is DecisionKind.QUEUE
    assert decision.reason == Reason.OVERLOADED


def test_goodput_rejects_with_retry_after_when_queueing_is_off(make_request, make_load, make_view) -> None:
    req = make_request(prompt=128, slo=SLO(ttft_ms=500, tpot_ms=100))
    policy = GoodputPolicy(GoodputConfig(queue_when_overloaded=False))
    decision = policy.route(req, _overloaded_view(make_load, make_view), 0.0)
    assert decision.kind is DecisionKind.REJECT
    assert decision.reason == Reason.OVERLOADED
    # ~2 s predicted TTFT against a 0.5 s target: retry once the backlog has drained.
    assert decision.retry_after_s is not None and 1.0 <= decision.retry_after_s <= 2.5
    assert decision.decode_worker_id is None


def test_goodput_never_breaks_the_tpot_target_of_requests_already_running(
    make_request, make_load, make_view
) -> None:
    # Adding one sequence to "strict" keeps it ~30 ms a token: fine for this request (100 ms)
    # but not for the 25 ms request already there.
    loads = [make_load("strict", batch=190, tightest_tpot_ms=25.0), make_load("lenient", batch=200)]
    decision = GoodputPolicy().route(make_request(), make_view(loads), 0.0)
    assert decision.decode_worker_id == "lenient"


def test_goodput_skips_a_worker_without_kv_room(make_request, make_load, make_view) -> None:
    loads = [make_load("full", free_blocks=10), make_load("roomy", batch=50)]
    assert GoodputPolicy().route(make_request(), make_view(loads), 0.0).decode_worker_id == "roomy"


def test_goodput_degrades_max_tokens_when_configured_and_that_fits(
    make_request, make_load, make_view
) -> None:
    # prompt 512 + 1024 new tokens needs 96 blocks; with half the tokens, 64 fit in 70.
    view = make_view([make_load("d0", free_blocks=70)])
    req = make_request(prompt=512, max_tokens=1024, hashes=())
    policy = GoodputPolicy(GoodputConfig(degrade_fraction=0.5))
    decision = policy.route(req, view, 0.0)
    assert (decision.kind, decision.max_tokens, decision.reason) == (
        DecisionKind.DEGRADE,
        512,
        Reason.DEGRADED,
    )
    assert GoodputPolicy().route(req, view, 0.0).kind is DecisionKind.QUEUE  # degrading is opt-in


def test_goodput_degrades_only_the_configured_tiers(make_request, make_load, make_view) -> None:
    view = make_view([make_load("d0", free_blocks=70)])
    policy = GoodputPolicy(GoodputConfig(degrade_fraction=0.5))
    plus = make_request(prompt=512, max_tokens=1024, hashes=(), tier=Tier.PLUS)
    assert policy.route(plus, view, 0.0).kind is DecisionKind.QUEUE
    both = GoodputPolicy(GoodputConfig(degrade_fraction=0.5, degrade_tiers=frozenset({Tier.FREE, Tier.PLUS})))
    assert both.route(plus, view, 0.0).kind is DecisionKind.DEGRADE


def test_goodput_serves_best_effort_what_no_idle_worker_could_serve_in_slo(
    make_request, make_load, make_view
) -> None:
    req = make_request(prompt=4096, slo=SLO(ttft_ms=1, tpot_ms=100))
    decision = GoodputPolicy().route(req, make_view([make_load("d0", batch=3), make_load("d1")]), 0.0)
    assert (decision.kind, decision.reason) == (DecisionKind.ROUTE, Reason.BEST_EFFORT)
    assert decision.decode_worker_id == "d1"


def test_goodput_keeps_a_conversation_on_the_worker_holding_its_prefix(
    make_request, make_load, make_view
) -> None:
    req = make_request(prompt=1024, conversation_id="c1")
    loads = [make_load("previous", batch=30), make_load("idle")]
    view = make_view(loads, cached={"previous": req.prefix_hashes[:50]}, conversations={"c1": "previous"})
    decision = GoodputPolicy().route(req, view, 0.0)
    assert (decision.decode_worker_id, decision.reason) == ("previous", Reason.CONVERSATION_AFFINITY)
    assert decision.cached_blocks == 50


def test_goodput_leaves_the_conversation_worker_when_it_would_miss_the_slo(
    make_request, make_load, make_view
) -> None:
    req = make_request(prompt=1024, conversation_id="c1", slo=SLO(ttft_ms=2000, tpot_ms=20))
    loads = [make_load("previous", batch=150), make_load("idle")]  # 25 ms a token on "previous"
    view = make_view(loads, conversations={"c1": "previous"})
    assert GoodputPolicy().route(req, view, 0.0).decode_worker_id == "idle"


@pytest.mark.parametrize(
    ("prompt", "cached_blocks", "site", "reason"),
    [
        (20, 0, None, "short_prompt"),
        (4096, 0, "p0", "remote_cheaper"),
        (4096, 250, None, "decode_cache_hit"),
        (4096, 100, "p0", "remote_cheaper"),
    ],
)
def test_goodput_sites_the_prefill_by_cost_next_to_a_running_batch(
    make_request, make_load, make_view, prompt, cached_blocks, site, reason
) -> None:
    req = make_request(prompt=prompt)
    loads = [make_load("d0", batch=8), make_load("p0", PREFILL)]
    view = make_view(loads, cached={"d0": req.prefix_hashes[:cached_blocks]})
    decision = GoodputPolicy().route(req, view, 0.0)
    assert (decision.decode_worker_id, decision.prefill_worker_id, decision.prefill_reason) == ("d0", site, reason)


def test_disaggregation_thresholds_are_configurable() -> None:
    rule = DisaggregationRule(min_remote_prefill_tokens=1000, max_cached_fraction=0.5)
    assert rule.prefill_locally(999, 0)
    assert not rule.prefill_locally(4000, 1000)
    assert rule.prefill_locally(4000, 2000)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "prefix_aware", "goodput"])
def test_every_policy_rejects_when_no_decode_worker_serves_the_model(
    make_request, make_load, make_view, name
):
    decision = make_policy(name).route(make_request(), make_view([make_load("p0", PREFILL)]), 0.0)
    assert (decision.kind, decision.reason) == (DecisionKind.REJECT, Reason.NO_WORKERS)
    assert decision.retry_after_s is not None


def test_make_policy_lists_valid_names_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match="round_robin, least_loaded, prefix_aware, goodput"):
        make_policy("random")


def test_tier_is_carried_but_placement_uses_the_request_slo(make_request, make_load, make_view) -> None:
    # The gateway turns a tier into SLO targets; the policy only reads the targets.
    strict = make_request(tier=Tier.ENTERPRISE, slo=SLO(ttft_ms=2000, tpot_ms=20))
    loads = [make_load("d0", batch=150)]
    assert GoodputPolicy().route(strict, make_view(loads), 0.0).kind is DecisionKind.QUEUE
    lenient = make_request(tier=Tier.ENTERPRISE, slo=SLO(ttft_ms=2000, tpot_ms=100))
    assert GoodputPolicy().route(lenient, make_view(loads), 0.0).kind is DecisionKind.ROUTE


def _slotted(make_snapshot, make_load, worker_id: str, batch: int, slots: int):
    snap = make_snapshot(worker_id, running_seqs=min(batch, slots), queue_depth=max(batch - slots, 0),
                         max_num_seqs=slots)
    return make_load(worker_id, batch=batch, snapshot=snap)


def test_a_full_worker_predicts_a_wait_for_a_slot_and_a_capped_batch(
    make_request, make_snapshot, make_load, make_view, fast_profile
) -> None:
    request = make_request(prompt=64, max_tokens=64)
    full = _slotted(make_snapshot, make_load, "one", batch=2, slots=1)  # one running, one waiting
    unlimited = make_load("one", batch=2)
    with_slots = evaluate(request, make_view([full]), full, None)
    without = evaluate(request, make_view([unlimited]), unlimited, None)
    step = fast_profile.decode_step_s(1, 0)
    # Half the running request's life, then the whole life of the one waiting ahead (64 steps each).
    expected_wait = step * 64 * (1 + 1 / 2)
    assert with_slots.ttft_s - without.ttft_s == pytest.approx(expected_wait, rel=0.01)
    assert with_slots.tpot_s == pytest.approx(fast_profile.decode_step_s(1, 0))  # alone in its slot


def test_goodput_avoids_a_full_one_slot_worker_that_looks_faster(
    make_request, make_snapshot, make_load, make_view
) -> None:
    loads = [
        _slotted(make_snapshot, make_load, "eight", batch=3, slots=8),
        _slotted(make_snapshot, make_load, "one", batch=1, slots=1),
    ]
    decision = GoodputPolicy().route(make_request(max_tokens=256), make_view(loads), 0.0)
    assert decision.decode_worker_id == "eight"


def test_least_loaded_prefers_a_free_slot_over_fewer_sequences(
    make_request, make_snapshot, make_load, make_view
) -> None:
    loads = [
        _slotted(make_snapshot, make_load, "a-one", batch=1, slots=1),
        _slotted(make_snapshot, make_load, "b-eight", batch=3, slots=8),
    ]
    assert LeastLoadedPolicy().route(make_request(), make_view(loads), 0.0).decode_worker_id == "b-eight"


def test_goodput_keeps_room_for_a_heavier_tier_seen_before(make_request, make_load, make_view) -> None:
    """Trunk reservation: a free request may not take the last placement an enterprise one could use."""
    policy = GoodputPolicy()
    tight, loose = SLO(ttft_ms=2000, tpot_ms=10.15), SLO(ttft_ms=2000, tpot_ms=100)
    view = make_view([make_load("d0", batch=0)])  # step 10 ms + 0.1 ms/seq: 10.1 ms alone, 10.2 ms beside the free one
    assert policy.route(make_request("ent", tier=Tier.ENTERPRISE, slo=tight), view, 0.0).is_placed
    busy = make_view([make_load("d0", batch=0)])
    assert policy.route(make_request("free", tier=Tier.FREE, slo=loose), busy, 1.0).kind is DecisionKind.QUEUE
    assert GoodputPolicy().route(make_request("free", tier=Tier.FREE, slo=loose), busy, 1.0).is_placed


def test_goodput_reserves_nothing_for_a_heavier_tier_no_longer_present(make_request, make_load, make_view) -> None:
    """The room kept above lasts while enterprise requests keep coming (`tier_memory_s`), not forever."""
    policy = GoodputPolicy()
    tight, loose = SLO(ttft_ms=2000, tpot_ms=10.15), SLO(ttft_ms=2000, tpot_ms=100)
    enterprise = make_request("ent", tier=Tier.ENTERPRISE, slo=tight)
    assert policy.route(enterprise, make_view([make_load("d0")]), 0.0).is_placed
    later = policy.config.tier_memory_s + 1.0
    busy = make_view([make_load("d0", batch=0)])
    assert policy.route(make_request("free", tier=Tier.FREE, slo=loose), busy, later).is_placed


def test_goodput_keeps_a_heavier_tier_room_it_can_count_on_not_a_guessed_slot_wait(make_request, make_load,
                                                                                   make_view) -> None:
    """Trunk reservation with a margin: a two-slot worker running one sequence. A free request taking the
    last slot would leave an enterprise request a predicted ~0.44 s wait for a slot against a 0.6 s TTFT
    target: within target (the reservation at zero margin lets the free request in), but the wait is a
    guess about the running sequences' remaining lives, under one expected error of headroom. The free
    request is held back; with the enterprise target at 2 s the same placement is allowed."""
    two_slots = make_load("d0", batch=1, snapshot=make_snapshot_with_slots("d0", slots=2, running=1))
    view = make_view([two_slots])

    def free_after_enterprise(enterprise_ttft_ms: float) -> DecisionKind:
        policy = GoodputPolicy()
        enterprise_slo = SLO(ttft_ms=enterprise_ttft_ms, tpot_ms=100)
        assert policy.route(make_request("ent", tier=Tier.ENTERPRISE, slo=enterprise_slo, max_tokens=128), view,
                            0.0).is_placed
        free = make_request("free", tier=Tier.FREE, slo=SLO(ttft_ms=6000, tpot_ms=500), max_tokens=128)
        return policy.route(free, view, 1.0).kind

    assert free_after_enterprise(600) is DecisionKind.QUEUE
    assert free_after_enterprise(2000) is DecisionKind.ROUTE


def test_goodput_weighs_a_queue_wait_as_less_certain_than_a_computed_step(make_request, make_load, make_view,
                                                                          fast_profile) -> None:
    """A one-slot worker busy with one sequence (TTFT = mostly the wait for its slot) against a batching
    worker whose TPOT is half the target: by relative slack the one-slot worker wins (TTFT slack ~0.66
    vs TPOT slack ~0.50), but its TTFT is a guess about the running sequence's remaining life, so the
    policy takes the batching worker, whose margin is ~5 expected errors against ~2."""
    batching = replace(fast_profile, decode_per_seq_s=0.0044)  # 9 sequences: a 49.6 ms step
    one_slot = make_load("one-slot", batch=1, snapshot=make_snapshot_with_slots("one-slot", slots=1, running=1))
    loads = [make_load("batching", batch=8), one_slot]
    view = make_view(loads, profiles={"batching": batching, "one-slot": fast_profile})
    req = make_request(prompt=128, max_tokens=128)
    placements = {p.decode.worker_id: p for p in (evaluate(req, view, w, None) for w in loads)}
    assert placements["one-slot"].slack(req) > placements["batching"].slack(req) > 0
    assert placements["batching"].confidence(req) > placements["one-slot"].confidence(req)
    assert GoodputPolicy().route(req, view, 0.0).decode_worker_id == "batching"


def make_snapshot_with_slots(worker_id: str, slots: int, running: int) -> WorkerSnapshot:
    return snapshot(worker_id, running_seqs=running, max_num_seqs=slots)
