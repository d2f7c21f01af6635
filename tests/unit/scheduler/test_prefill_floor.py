"""The prefill floor (scheduler/core/cost_model.py): no prefill step is cheaper than it, in the profile,
the scheduler's CostModel and the simulator alike; old profiles without it keep the plain line."""

from __future__ import annotations

import json
import random

import pytest

from scheduler.core.cost_model import CostModel, WorkerProfile
from scheduler.sim.sequence import SimSequence
from scheduler.sim.serving import ServingCost
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, PrefillSample, Tier, WorkerRole

# The shape of the 4xH100 profile of docs/benchmarks.md: 22 ms up to ~680 tokens, then 1 ms + 31 us/token.
FLOORED = WorkerProfile(prefill_fixed_s=0.001, prefill_per_token_s=3.1e-5, prefill_per_token_sq_s=0.0,
                        prefill_floor_s=0.022)


def test_a_step_costs_the_floor_below_the_knee_and_the_line_above_it() -> None:
    assert FLOORED.prefill_s(16) == pytest.approx(0.022)
    assert FLOORED.prefill_s(512) == pytest.approx(0.022)
    assert FLOORED.prefill_s(2048) == pytest.approx(0.001 + 3.1e-5 * 2048)
    # Four 512-token chunks in one step cost the line at 2048 tokens, not four floors nor 512's cost.
    assert FLOORED.prefill_step_s(2048, 4 * 512 * 512) == pytest.approx(FLOORED.prefill_s(2048))


def test_the_cost_model_predicts_the_floor_and_drains_a_queue_floor_by_floor() -> None:
    cost = CostModel(FLOORED)
    assert cost.prefill_s(64) == pytest.approx(0.022)
    assert cost.prefill_s(2048) == pytest.approx(FLOORED.prefill_s(2048))
    assert cost.prefill_backlog_s(queued_tokens=4 * 64, queued_requests=4) == pytest.approx(4 * 0.022)
    two_long = cost.prefill_backlog_s(queued_tokens=2 * 2048, queued_requests=2)
    assert two_long == pytest.approx(2 * FLOORED.prefill_s(2048))


def test_samples_on_the_floor_leave_the_line_alone_and_samples_above_it_refit_it() -> None:
    cost = CostModel(FLOORED)
    for _ in range(200):
        cost.observe(PrefillSample(64, 0.030, 64 * 64))  # a slow floor step: not the line's business
    assert cost.fitted_profile().prefill_per_token_s == pytest.approx(FLOORED.prefill_per_token_s)
    assert cost.fitted_profile().prefill_floor_s == FLOORED.prefill_floor_s
    for tokens in (1024, 1536, 2048) * 50:
        cost.observe(PrefillSample(tokens, 2 * FLOORED.prefill_s(tokens), tokens * tokens))  # twice as slow
    assert cost.prefill_s(2048) == pytest.approx(2 * FLOORED.prefill_s(2048), rel=0.05)


def test_a_profile_written_before_the_floor_loads_as_the_plain_line() -> None:
    old = {k: v for k, v in json.loads(FLOORED.to_json()).items() if k != "prefill_floor_s"}
    profile = WorkerProfile.from_dict(old)
    assert profile.prefill_floor_s == 0.0
    assert profile.prefill_s(16) == pytest.approx(0.001 + 3.1e-5 * 16)
    assert CostModel(profile).prefill_s(16) == pytest.approx(profile.prefill_s(16))
    with pytest.raises(ValueError, match="non-negative"):
        WorkerProfile(prefill_floor_s=-0.001)


def _prefill_worker(serving: ServingCost) -> SimWorker:
    spec = SimWorkerSpec("p", WorkerRole.PREFILL, FLOORED, max_prefill_tokens=2048, max_prefill_chunk=512,
                         serving=serving)
    return SimWorker(spec, random.Random(0), noise=0.0)


def _remote(worker: SimWorker, prompt: int, label: int) -> SimSequence:
    arrival = Arrival(0.0, f"r{label}", prompt, 8, extend_chain((), prompt // 16, label=label), Tier.FREE)
    seq = SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="d", prefill_worker="p")
    worker.enqueue_prefill(seq)
    return seq


def test_simulated_chunks_pay_the_floor_and_the_served_prefill_terms() -> None:
    serving = ServingCost(per_prefill_step_s=0.008, per_prefill_done_s=0.010)
    worker = _prefill_worker(serving)
    seq = _remote(worker, 1024, 0)  # two 512-token chunks, each on the floor
    first = worker.start_step(0.0)
    assert first == pytest.approx(0.022 + 0.008)  # not done yet: no per-prompt term
    worker.finish_step(first)
    second = worker.start_step(first)
    assert second == pytest.approx(0.022 + 0.008 + 0.010)  # its last chunk: the prompt is done
    outcome = worker.finish_step(first + second)
    assert [job.seq for job in outcome.prefilled] == [seq]
    assert (seq.prefill_started_at, seq.prefilled_at) == (0.0, pytest.approx(first + second))


def test_chunks_of_several_prompts_share_one_step_at_the_line_not_one_floor_each() -> None:
    worker = _prefill_worker(ServingCost())
    for label in range(4):
        _remote(worker, 512, label)
    assert worker.start_step(0.0) == pytest.approx(FLOORED.prefill_s(2048))
