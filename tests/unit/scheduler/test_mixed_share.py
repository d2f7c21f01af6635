"""The mixed-step decode share: learnt from reported mixed steps, it prices what a prompt adds to a
running batch's step (its TTFT, the batch's TPOT rise, and the prefill share that stretches TPOT)."""

import math
import random

import pytest

from scheduler.core.cost_model import MIN_OWN_SAMPLES, PRIOR_MIXED_DECODE_SHARE, CostModel, WorkerProfile
from scheduler.core.placement import evaluate
from scheduler.core.policies import LeastLoadedPolicy
from scheduler.core.prefill_load import prefill_share
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import DecodeSample, MixedSample, PrefillSample, WorkerRole
from tests.unit.scheduler.conftest import load, request, snapshot, view

PROFILE = WorkerProfile(prefill_fixed_s=0.08, prefill_per_token_s=2e-4, prefill_per_token_sq_s=0.0,
                        decode_fixed_s=0.07, decode_per_seq_s=0.02, decode_per_context_token_s=0.0)


def _mixed(profile: WorkerProfile, share: float, tokens: int, batch: int, noise: float = 0.0,
           rng: random.Random | None = None) -> MixedSample:
    seconds = profile.prefill_step_s(tokens, tokens * tokens) + share * profile.decode_step_s(batch, 0)
    if rng is not None:
        seconds *= 1.0 + rng.gauss(0.0, noise)
    return MixedSample(tokens, tokens * tokens, batch, 0, seconds)


def test_the_share_is_fitted_with_the_prefill_line_from_noisy_mixed_steps() -> None:
    rng = random.Random(3)
    model = CostModel(WorkerProfile())  # seeded with the (wrong) defaults
    for _ in range(400):
        tokens = rng.randint(16, 512)
        batch = rng.randint(1, 8)
        model.observe(DecodeSample(batch, 0, PROFILE.decode_step_s(batch, 0) * (1 + rng.gauss(0, 0.05))))
        if rng.random() < 0.1:  # a batching worker runs few prompts alone
            model.observe(PrefillSample(tokens, PROFILE.prefill_s(tokens) * (1 + rng.gauss(0, 0.05))))
        else:
            model.observe(_mixed(PROFILE, 0.3, tokens, rng.randint(1, 8), noise=0.05, rng=rng))
    assert model.mixed_decode_share == pytest.approx(0.3, abs=0.05)
    assert model.prefill_s(256) == pytest.approx(PROFILE.prefill_s(256), rel=0.05)


def test_the_share_is_the_prior_until_mixed_steps_arrive_and_never_above_it() -> None:
    model = CostModel(PROFILE)
    assert model.mixed_decode_share == PRIOR_MIXED_DECODE_SHARE == 1.0
    for tokens in (64, 128, 256, 512) * 5:
        model.observe(PrefillSample(tokens, PROFILE.prefill_s(tokens)))
    assert model.mixed_decode_share == pytest.approx(1.0)  # pure prefills say nothing about it
    for batch in (1, 2, 4, 8) * 10:
        model.observe(_mixed(PROFILE, 1.6, 128, batch))  # dearer than prefill + decode: noise, or a slow host
    assert model.mixed_decode_share == 1.0


def test_a_mixed_step_whose_prefill_is_on_the_floor_is_not_fitted() -> None:
    floored = WorkerProfile(prefill_fixed_s=0.001, prefill_per_token_s=1e-5, prefill_floor_s=0.02,
                            decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_context_token_s=0.0)
    model = CostModel(floored)
    for batch in (1, 2, 4, 8) * 10:
        model.observe(_mixed(floored, 0.2, 256, batch))  # 256 tokens: 3.6 ms of line, under the floor
    assert model.mixed_decode_share == 1.0
    model.observe(_mixed(floored, 0.2, 4096, 8))  # above it
    assert model.mixed_decode_share < 1.0


def test_a_worker_without_steps_of_its_own_reads_the_pooled_share() -> None:
    pool = CostModel(PROFILE)
    model = CostModel(PROFILE, pool=pool)
    for batch in (1, 2, 4, 8) * 10:
        pool.observe(_mixed(PROFILE, 0.3, 128, batch))
    assert model.mixed_decode_share == pytest.approx(pool.mixed_decode_share)
    assert pool.mixed_decode_share == pytest.approx(0.3, abs=0.05)
    for batch in (1, 2, 4, 8) * (MIN_OWN_SAMPLES // 4 + 1):
        model.observe(_mixed(PROFILE, 0.8, 128, batch))
    assert model.mixed_decode_share > 0.7  # its own, once it has enough


def test_pure_steps_leave_the_share_alone() -> None:
    model = CostModel(PROFILE)
    model.observe(PrefillSample(64, 0.1))
    model.observe(DecodeSample(4, 0, 0.15))
    assert model.mixed_decode_share == 1.0


def test_a_prompt_adds_its_prefill_less_the_decode_step_a_mixed_step_saves() -> None:
    model = CostModel(PROFILE)
    for batch in (1, 2, 4, 8) * 10:
        model.observe(_mixed(PROFILE, 0.25, 512, batch))
    share = model.mixed_decode_share
    prefill, running = model.prefill_s(512), PROFILE.decode_step_s(4, 0)
    assert model.mixed_step_s(512, 0, running) == pytest.approx(prefill + share * running)
    assert model.prefill_added_s(512, 0, running) == pytest.approx(prefill - (1 - share) * running)
    assert model.prefill_added_s(512, 0, 0.0) == pytest.approx(prefill)  # nothing running: the whole prefill
    assert model.prefill_added_s(512, 0, 10.0) == 0.0  # never negative


def _batching_worker_view(share: float):
    snap = snapshot("w", WorkerRole.BOTH, max_num_seqs=8)
    worker = load("w", WorkerRole.BOTH, batch=4, snapshot=snap)
    cluster = view([worker])
    truth = cluster.cost("w").fitted_profile()
    for batch in (1, 2, 4, 8) * 10:
        cluster.cost("w").observe(_mixed(truth, share, 256, batch))
    return cluster, worker


def test_a_local_prompt_on_a_worker_whose_mixed_steps_are_cheap_predicts_a_faster_first_token_and_less_interference(
) -> None:
    dear_view, dear = _batching_worker_view(1.0)
    cheap_view, cheap = _batching_worker_view(0.2)
    req = request(prompt=256, max_tokens=8)
    at_one, at_cheap = evaluate(req, dear_view, dear, None), evaluate(req, cheap_view, cheap, None)
    cost = cheap_view.cost("w")
    running = cost.decode_step_s(4, cheap.context_tokens)
    assert cost.mixed_decode_share < 0.3
    assert at_cheap.ttft_s == pytest.approx(cost.prefill_s(256) + cost.mixed_decode_share * running)  # idle queue
    assert at_cheap.ttft_s < at_one.ttft_s
    assert at_cheap.added_tpot_s == pytest.approx(cost.prefill_added_s(256, 0, running) / 4)
    assert at_cheap.added_tpot_s < at_one.added_tpot_s


def test_the_prefill_share_a_batch_sees_is_what_the_prompts_placed_add_to_its_own_step() -> None:
    def routed(share: float) -> Scheduler:
        scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=5.0))
        scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
        truth = scheduler.cost_model("w").fitted_profile()
        samples = [_mixed(truth, share, 256, batch) for batch in (1, 2, 4, 8) * 10]
        scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH, running_seqs=4), samples, [], now=0.0)
        for i in range(10):
            assert scheduler.route(request(f"r{i}", prompt=256), now=0.1 * i).decode_worker_id == "w"
        return scheduler

    dear, cheap = routed(1.0), routed(0.2)
    cost = cheap.cost_model("w")
    assert cost.mixed_decode_share < 0.25 and dear.cost_model("w").mixed_decode_share == pytest.approx(1.0)
    observed = -math.expm1(-2.0 / 5.0)  # one second of history counts as the 2 s minimum window
    decay = sum(math.exp(-(1.0 - 0.1 * i) / 5.0) for i in range(10)) / 5.0 / observed
    loaded = cheap.worker_loads(1.0)[0]
    # Every prompt's whole prefill, and the prompts: whatever ran when each was placed.
    assert loaded.prefill_work_rate == pytest.approx(cost.prefill_s(256) * decay, rel=1e-6)
    assert loaded.prefill_rate == pytest.approx(decay, rel=1e-6)
    step = cost.decode_step_s(4, 0)
    seen = prefill_share(loaded.prefill_work_rate, loaded.prefill_rate, cost.mixed_decode_share, step)
    assert seen == pytest.approx(decay * cost.prefill_added_s(256, 0, step), rel=1e-6)
    dear_loaded, dear_cost = dear.worker_loads(1.0)[0], dear.cost_model("w")
    dear_seen = prefill_share(dear_loaded.prefill_work_rate, dear_loaded.prefill_rate, dear_cost.mixed_decode_share,
                              step)
    assert seen < dear_seen == pytest.approx(dear_loaded.prefill_work_rate)  # a step that saves nothing


def test_a_prompt_placed_on_an_idle_worker_counts_what_it_adds_to_a_later_batch_not_its_whole_prefill() -> None:
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=5.0))
    scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
    truth = scheduler.cost_model("w").fitted_profile()
    samples = [_mixed(truth, 0.2, 256, batch) for batch in (1, 2, 4, 8) * 10]
    scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH), samples, [], now=0.0)
    scheduler.route(request("first", prompt=256), now=0.0)  # nothing decodes there: a pure prefill
    scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH, running_seqs=3), [], [], now=0.5)
    probe = scheduler.route(request("probe", prompt=32, max_tokens=8), now=0.5)
    cost = scheduler.cost_model("w")
    assert probe.predicted_tpot_ms is not None and probe.predicted_stretch_ms is not None
    step_ms = probe.predicted_tpot_ms - probe.predicted_stretch_ms
    loaded = scheduler.worker_loads(0.5)[0]
    share = prefill_share(loaded.prefill_work_rate, loaded.prefill_rate, cost.mixed_decode_share, step_ms / 1e3)
    assert 0.0 < share < loaded.prefill_work_rate  # less than the whole prefill: the batch's step is saved
