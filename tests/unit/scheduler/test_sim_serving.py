"""The serving cost a simulated step adds to the profile's runner time (scheduler/sim/serving.py), the
planner's use of it, and its fit from a run's token gaps (scheduler/calibration/serving.py; the runs are read by
lab/experiments/serving_cost.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lab.experiments.serving_cost import gaps
from loadtest.records import RequestRecord
from scheduler.calibration.serving import Bucket, buckets, fit_serving_cost
from scheduler.core.cost_model import WorkerProfile
from scheduler.planner import Layout, PlanConfig, workers_for
from scheduler.sim.sequence import SimSequence
from scheduler.sim.serving import MEASURED_H100, ServingCost, StepShape
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole

PROFILE = WorkerProfile(decode_fixed_s=0.008, decode_per_seq_s=1e-5, decode_per_context_token_s=0.0)


def _decode_step_s(batch: int, serving: ServingCost) -> float:
    """One decode step of `batch` running sequences on a simulated decode worker (no noise)."""
    worker = SimWorker(SimWorkerSpec("d", WorkerRole.DECODE, PROFILE, serving=serving), random.Random(0), noise=0.0)
    for i in range(batch):
        arrival = Arrival(0.0, f"r{i}", 64, 8, extend_chain((), 4, label=i), Tier.FREE)
        seq = SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="d", prefill_worker="p")
        worker.admit(seq)
        worker.allocate_waiting()
        worker.join(seq, 0.0)
    duration = worker.start_step(0.0)
    assert duration is not None
    return duration


def test_a_decode_step_costs_the_profile_plus_the_serving_cost_per_step_and_sequence() -> None:
    serving = ServingCost(per_step_s=0.001, per_seq_s=1e-4)
    for batch in (1, 32, 128):
        runner = PROFILE.decode_step_s(batch, 64 * batch)
        assert _decode_step_s(batch, ServingCost()) == pytest.approx(runner)
        assert _decode_step_s(batch, serving) == pytest.approx(runner + 0.001 + 1e-4 * batch)


def test_long_contexts_cost_more_per_token_when_the_serving_cost_says_so() -> None:
    serving = ServingCost(per_context_token_s=2e-8)
    for batch in (1, 32, 128):
        runner = PROFILE.decode_step_s(batch, 64 * batch)
        context = (64 + 1) * batch  # the prompt and the first token
        assert _decode_step_s(batch, serving) == pytest.approx(runner + 2e-8 * context)


def test_the_prefill_terms_price_only_the_hand_off_path() -> None:
    serving = ServingCost(per_seq_s=1e-4, per_prefill_step_s=0.008, per_prefill_done_s=0.010)
    local = StepShape(decoding=3, context_tokens=300, prompts_done=1)
    remote = StepShape(prompts_done=1, remote_prefill=True, handed_off=1)
    assert serving.step_s(local) == pytest.approx(4e-4)
    assert serving.step_s(remote) == pytest.approx(1e-4 + 0.008 + 0.010)


def test_an_idle_step_costs_nothing_and_negative_costs_are_refused() -> None:
    assert ServingCost(0.001, 1e-4).step_s(StepShape()) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        ServingCost(per_seq_s=-1e-6)


def test_the_planner_gives_every_simulated_worker_its_serving_cost() -> None:
    config = PlanConfig(gpus=4, slo=SLO(500, 50))
    assert config.serving == MEASURED_H100
    specs = workers_for(Layout(1, 3), {1: PROFILE}, config)
    assert [s.serving for s in specs] == [MEASURED_H100] * 4
    assert all(s.profile.decode_fixed_s == PROFILE.decode_fixed_s for s in specs)  # the scheduler's seed: unchanged


def _stream(start: float, gap_s: float, tokens: int) -> RequestRecord:
    return RequestRecord(request_id=f"s{start}", session_id=0, turn=0, send_time=start, prompt_len=100,
                         max_tokens=tokens, ok=True,
                         ttft=0.0, chunk_gaps=[gap_s] * (tokens - 1), output_tokens=tokens, prompt_tokens=100)


def test_the_fit_recovers_a_known_per_sequence_cost_from_token_gaps() -> None:
    """Batches of 8 and 24 streams whose gaps are the profile's step + 2 ms + 100 us per sequence."""
    def gap(batch: int) -> float:
        return PROFILE.decode_step_s(batch, 0) + 0.002 + 1e-4 * batch

    records = [_stream(0.0, gap(8), 40) for _ in range(8)] + [_stream(10.0, gap(24), 20) for _ in range(24)]
    rows = buckets(gaps(records), WorkerProfile(decode_fixed_s=PROFILE.decode_fixed_s,
                                                decode_per_seq_s=PROFILE.decode_per_seq_s,
                                                decode_per_context_token_s=0.0))
    assert [round(b.batch) for b in rows] == [8, 24]
    cost = fit_serving_cost(rows)
    assert cost.per_seq_s == pytest.approx(1e-4, rel=1e-6)
    assert cost.per_step_s == pytest.approx(0.002, rel=1e-6)


def test_the_fit_needs_two_batch_sizes() -> None:
    with pytest.raises(ValueError, match="2 batch buckets"):
        fit_serving_cost([Bucket(8.0, 100.0, 0.01, 0.002)])


def test_the_planner_simulates_the_heartbeat_the_scheduler_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import scheduler.planner as planner
    from scheduler.adapters.servicer import ServicerConfig
    from scheduler.plan_workload import SyntheticLengths, synthetic_trace
    from scheduler.planner import simulate

    seen: list[float] = []
    real_replay = planner.replay

    def spy(trace, workers, policy, slo, config):  # type: ignore[no-untyped-def]
        seen.append(config.heartbeat_interval_s)
        return real_replay(trace, workers, policy, slo, config)

    monkeypatch.setattr(planner, "replay", spy)
    trace = synthetic_trace(SyntheticLengths("fixed", 64), SyntheticLengths("fixed", 4), rate=5.0, requests=5)
    simulate(trace, Layout(0, 1), {1: PROFILE}, PlanConfig(gpus=1, slo=SLO(500, 50), search_rate=False))
    assert seen == [ServicerConfig().heartbeat_interval_s] == [PlanConfig.heartbeat_s]
    with pytest.raises(ValueError, match="heartbeat_s > 0"):
        PlanConfig(gpus=1, slo=SLO(500, 50), heartbeat_s=0.0)


def test_remote_kv_landing_mid_step_is_committed_when_the_step_ends() -> None:
    worker = SimWorker(SimWorkerSpec("d", WorkerRole.DECODE, PROFILE), random.Random(0), noise=0.0)

    def remote(i: int) -> SimSequence:
        arrival = Arrival(0.0, f"r{i}", 64, 8, extend_chain((), 4, label=i), Tier.FREE)
        seq = SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="d", prefill_worker="p")
        worker.admit(seq)
        worker.allocate_waiting()
        return seq

    first, second = remote(0), remote(1)
    assert worker.land(first, 0.0) is None and first.first_token_at == 0.0  # idle: committed at once
    step = worker.start_step(0.0)
    assert step is not None
    assert worker.land(second, step / 2) is None and second.first_token_at is None  # mid-step: waits
    worker.finish_step(step)
    assert second.first_token_at == step


def test_the_simulated_scheduler_can_start_from_another_profile_than_the_workers_truth() -> None:
    seed = WorkerProfile(prefill_fixed_s=0.019)
    config = PlanConfig(gpus=2, slo=SLO(500, 50), handoff_s=0.011, scheduler_seed=seed)
    specs = workers_for(Layout(1, 1), {1: PROFILE}, config)
    assert all(s.scheduler_seed == replace(seed, transfer_fixed_s=0.011) for s in specs)
    assert all(s.profile.prefill_fixed_s == PROFILE.prefill_fixed_s for s in specs)
    assert all(s.scheduler_seed is None for s in workers_for(Layout(1, 1), {1: PROFILE}, PlanConfig(2, SLO(500, 50))))
