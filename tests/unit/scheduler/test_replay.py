"""Replay: the simulator's arithmetic on a single request, traces, determinism. The policy comparisons
run in it are in test_policy_core_in_replay.py."""

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import make_policy
from scheduler.replay import ReplayConfig, ReplayResult, ReplayRun, replay
from scheduler.sim.scenarios import heterogeneous_cluster, heterogeneous_workload, tier_slos
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, WorkloadSpec, extend_chain, make_trace
from scheduler.types import SLO, Tier, WorkerRole

PROFILE = WorkerProfile(
    prefill_fixed_s=0.01,
    prefill_per_token_s=1e-4,
    prefill_per_token_sq_s=0.0,
    decode_fixed_s=0.02,
    decode_per_seq_s=0.0,
    decode_per_context_token_s=0.0,
    transfer_fixed_s=0.005,
    transfer_per_token_s=1e-5,
)
EXACT = ReplayConfig(step_noise=0.0)


def one_request(prompt: int = 1000, output: int = 11) -> list[Arrival]:
    return [Arrival(1.0, "r0", prompt, output, extend_chain((), prompt // 16, 0), Tier.FREE)]


def test_disaggregated_request_latencies_follow_the_profile() -> None:
    workers = [
        SimWorkerSpec("p", WorkerRole.PREFILL, PROFILE),
        SimWorkerSpec("d", WorkerRole.DECODE, PROFILE),
    ]
    result = replay(one_request(), workers, "round_robin", SLO(ttft_ms=500, tpot_ms=50), EXACT)
    [outcome] = result.outcomes
    assert outcome.prefill_worker_id == "p"
    assert outcome.ttft_s == pytest.approx(0.01 + 0.1 + 0.005 + 0.01)  # prefill + transfer of 1000 tokens
    assert outcome.tpot_s == pytest.approx(0.02)  # ten decode steps for tokens 2..11
    assert outcome.met_slo and result.goodput == 1.0


def test_a_short_prompt_is_prefilled_on_the_decode_worker() -> None:
    workers = [
        SimWorkerSpec("p", WorkerRole.PREFILL, PROFILE),
        SimWorkerSpec("d", WorkerRole.DECODE, PROFILE),
    ]
    result = replay(one_request(prompt=100), workers, "round_robin", SLO(ttft_ms=500, tpot_ms=50), EXACT)
    [outcome] = result.outcomes
    assert outcome.prefill_worker_id is None
    assert outcome.ttft_s == pytest.approx(0.01 + 0.01)  # no transfer


def test_the_client_overhead_adds_to_ttft_and_counts_against_the_slo() -> None:
    workers = [SimWorkerSpec("d", WorkerRole.BOTH, PROFILE)]
    config = ReplayConfig(step_noise=0.0, client_overhead_s=0.05)
    result = replay(one_request(prompt=100), workers, "round_robin", SLO(ttft_ms=60, tpot_ms=50), config)
    [outcome] = result.outcomes
    assert outcome.ttft_s == pytest.approx(0.01 + 0.01 + 0.05)
    assert outcome.tpot_s == pytest.approx(0.02)  # the way out delays every token alike
    assert not outcome.met_slo  # 70 ms > 60 ms; without the overhead it would have met it


def test_a_missed_target_is_counted_against_goodput() -> None:
    workers = [SimWorkerSpec("d", WorkerRole.BOTH, PROFILE)]
    result = replay(one_request(), workers, "round_robin", SLO(ttft_ms=500, tpot_ms=10), EXACT)
    assert not result.outcomes[0].met_slo
    assert result.goodput == 0.0


def test_every_arrival_gets_exactly_one_outcome() -> None:
    trace = heterogeneous_workload(rate_per_s=30, num_requests=200)
    result = replay(trace, heterogeneous_cluster(), "goodput", tier_slos())
    assert [o.request_id for o in result.outcomes] == [a.request_id for a in trace]
    assert all(o.rejected or o.ttft_s is not None for o in result.outcomes)


def test_replay_is_deterministic_for_a_seed() -> None:
    trace = heterogeneous_workload(rate_per_s=20, num_requests=150)
    first = replay(trace, heterogeneous_cluster(), "goodput", tier_slos())
    second = replay(trace, heterogeneous_cluster(), "goodput", tier_slos())
    assert first.outcomes == second.outcomes


def test_conversation_followups_reuse_their_prefix_hashes() -> None:
    trace = make_trace(
        WorkloadSpec(num_requests=300, rate_per_s=50, followup_min_gap_s=0.5, document_fraction=0)
    )
    by_conversation: dict[str, list[Arrival]] = {}
    for arrival in trace:
        assert arrival.conversation_id is not None
        by_conversation.setdefault(arrival.conversation_id, []).append(arrival)
    turns = next(t for t in by_conversation.values() if len(t) >= 2)
    earlier, later = turns[0].prefix_hashes, turns[1].prefix_hashes
    assert later[: len(earlier)] == earlier


def test_a_remote_reservation_waits_for_the_decode_step_in_flight() -> None:
    workers = [SimWorkerSpec("p", WorkerRole.PREFILL, PROFILE), SimWorkerSpec("d", WorkerRole.DECODE, PROFILE)]
    trace = [*one_request(), Arrival(1.13, "r1", 1000, 11, extend_chain((), 1000 // 16, 1), Tier.FREE)]
    result = replay(trace, workers, "round_robin", SLO(ttft_ms=500, tpot_ms=50), EXACT)
    first, second = sorted(result.outcomes, key=lambda o: o.request_id)
    assert first.prefill_compute_s == second.prefill_compute_s == pytest.approx(0.11)  # the prefill phase alone
    # r0 decodes in 20-ms steps from 1.125. r1 arrives mid-step: its blocks are reserved (and its prefill
    # starts) at 1.145, its KV lands at 1.27 mid-step and is committed at 1.285.
    assert second.ttft_s == pytest.approx(1.285 - 1.13)


def test_a_replay_run_gives_each_worker_the_noise_it_is_given() -> None:
    """The public ReplayRun (the lab's policy simulator gives each worker its fitted noise through it): a
    worker's own noise replaces config.step_noise, one not named keeps it."""
    trace, workers, slos = heterogeneous_workload(rate_per_s=20, num_requests=80), heterogeneous_cluster(), tier_slos()
    noisy = ReplayConfig(step_noise=0.2)

    def run(config: ReplayConfig, noise: dict[str, float] | None) -> ReplayResult:
        replay_run = ReplayRun(trace, workers, make_policy("goodput"), slos.__getitem__, config, noise)
        replay_run.run()
        return replay_run.result("goodput")

    quiet = run(noisy, {w.worker_id: 0.0 for w in workers})
    assert quiet.outcomes == replay(trace, workers, "goodput", slos, ReplayConfig(step_noise=0.0)).outcomes
    assert run(noisy, None).outcomes == replay(trace, workers, "goodput", slos, noisy).outcomes
    assert quiet.outcomes != run(noisy, None).outcomes
