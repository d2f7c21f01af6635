"""The mixed-step decode share: learnt from reported mixed steps, it prices what a prompt adds to a
running batch's step (its TTFT, the batch's TPOT rise, and the prefill share that stretches TPOT)."""

import math
import random

import pytest

from scheduler.core.cost_model import MIN_OWN_SAMPLES, PRIOR_MIXED_DECODE_SHARE, CostModel, WorkerProfile
from scheduler.core.placement import evaluate
from scheduler.core.policies import LeastLoadedPolicy
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


def test_placements_on_a_batching_worker_count_only_what_their_prompts_add_to_its_prefill_share() -> None:
    def routed(share: float) -> Scheduler:
        scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=5.0))
        scheduler.register(snapshot("w", WorkerRole.BOTH, running_seqs=4), now=0.0)
        truth = scheduler.cost_model("w").fitted_profile()
        samples = [_mixed(truth, share, 256, batch) for batch in (1, 2, 4, 8) * 10]
        scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH, running_seqs=4), samples, [], now=0.0)
        for i in range(10):
            assert scheduler.route(request(f"r{i}", prompt=256), now=0.1 * i).decode_worker_id == "w"
        return scheduler

    dear, cheap = routed(1.0), routed(0.2)
    cost = cheap.cost_model("w")
    assert cost.mixed_decode_share < 0.25 and dear.cost_model("w").mixed_decode_share == pytest.approx(1.0)
    # Each placement shares its steps with the four running sequences and those placed before it
    # (reserved at their mid-life context: prompt + max_tokens // 2).
    added = [cost.prefill_added_s(256, 0, cost.decode_step_s(4 + i, i * (256 + 32))) for i in range(10)]
    observed = -math.expm1(-2.0 / 5.0)  # one second of history counts as the 2 s minimum window
    expected = sum(a / 5.0 * math.exp(-(1.0 - 0.1 * i) / 5.0) for i, a in enumerate(added)) / observed
    at_cheap, at_dear = cheap.worker_loads(1.0)[0].prefill_share, dear.worker_loads(1.0)[0].prefill_share
    assert at_cheap == pytest.approx(expected, rel=0.01)
    assert at_cheap < at_dear
