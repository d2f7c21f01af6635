"""The measured cost of prompt chunks folded into a decoding batch's steps (prefill_load.FoldedCost): once a
worker reports mixed steps, its prefill share is that cost times the chunks of the prompts placed there."""

import math

import pytest

from scheduler.core.placement import decode_side, evaluate, sliced_prefill_s
from scheduler.core.policies import LeastLoadedPolicy
from scheduler.core.prefill_load import FoldedCost, measured_share, prefill_chunks
from scheduler.core.registry import MIN_FOLDED_STEPS
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import DecodeSample, MixedSample, WorkerRole
from tests.unit.scheduler.conftest import load, request, snapshot, view

WINDOW_S = 5.0


def test_the_cost_is_the_mixed_steps_excess_per_chunk_placed_once_there_are_enough_steps() -> None:
    folded = FoldedCost(time_constant_s=10.0, min_steps=3)
    folded.add_chunks(4, now=0.0)
    folded.add_step(0.020, now=0.0)
    folded.add_step(0.030, now=0.0)
    assert folded.per_chunk_s(now=0.0) is None  # two steps
    folded.add_step(0.010, now=0.0)
    assert folded.per_chunk_s(now=0.0) == pytest.approx(0.060 / 4)
    cheap = FoldedCost(time_constant_s=10.0, min_steps=1)
    cheap.add_step(-0.010, now=0.0)  # a CPU pass that computes part of the decodes with the prompt
    assert cheap.per_chunk_s(now=0.0) is None  # no chunk placed yet
    cheap.add_chunks(1, now=0.0)
    assert cheap.per_chunk_s(now=0.0) == 0.0
    with pytest.raises(ValueError):
        FoldedCost(time_constant_s=0.0, min_steps=1)


def test_recent_steps_and_chunks_outweigh_old_ones_by_their_age() -> None:
    folded = FoldedCost(time_constant_s=5.0, min_steps=1)
    folded.add_chunks(10, now=0.0)
    folded.add_step(0.100, now=0.0)  # 10 ms a chunk
    folded.add_chunks(10, now=10.0)
    folded.add_step(0.200, now=10.0)  # then 20 ms
    old = math.exp(-2.0)
    assert folded.per_chunk_s(now=10.0) == pytest.approx((0.100 * old + 0.200) / (10 * old + 10))
    assert folded.per_chunk_s(now=20.0) == pytest.approx(folded.per_chunk_s(now=10.0))  # both sums decay alike
    assert measured_share(20.0, 0.010) == pytest.approx(0.2)


def test_a_prompt_is_prefilled_in_slices_of_the_engines_chunk() -> None:
    assert [prefill_chunks(n, 512) for n in (1, 512, 513, 2048)] == [1, 1, 2, 4]
    assert prefill_chunks(2048, 0) == 1  # a worker that does not say: whole prompts


def _worker(mixed_s: float, steps: int, chunk: int = 512, prompt: int = 2048) -> Scheduler:
    """A worker reporting `chunk`-token prefill slices, that decoded 4 sequences in 10 ms and folded
    prompt slices into that batch's steps, each then taking `mixed_s`; then ten prompts placed on it in a
    second while it decodes."""
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=WINDOW_S))
    busy = snapshot("w", WorkerRole.BOTH, running_seqs=4, max_prefill_chunk=chunk)
    scheduler.register(busy, now=0.0)
    decodes = [DecodeSample(batch_size=4, context_tokens=4096, seconds=0.010)] * 40
    mixed = [MixedSample(prefill_tokens=chunk, attention_tokens_sq=chunk * chunk, batch_size=4,
                         context_tokens=4096, seconds=mixed_s)] * steps
    scheduler.on_heartbeat(busy, [*decodes, *mixed], [], now=0.0)
    for i in range(10):
        assert scheduler.route(request(f"r{i}", prompt=prompt), now=0.1 * i).decode_worker_id == "w"
    return scheduler


def _decayed(amount: float, now: float = 1.0) -> float:
    """Ten placements of `amount`, 0.1 s apart from 0, as a rate at `now` (the 2-s minimum window)."""
    return sum(amount / WINDOW_S * math.exp(-(now - 0.1 * i) / WINDOW_S) for i in range(10)) / -math.expm1(
        -2.0 / WINDOW_S)


def test_a_worker_whose_mixed_steps_were_measured_stretches_tpot_by_their_cost_per_chunk() -> None:
    scheduler = _worker(mixed_s=0.035, steps=MIN_FOLDED_STEPS)
    excess = MIN_FOLDED_STEPS * (0.035 - scheduler.cost_model("w").decode_step_s(4, 4096))
    loaded = scheduler.worker_loads(1.0)[0]
    assert loaded.prefill_chunk_rate == pytest.approx(_decayed(4))  # 2,048 tokens in 512-token slices
    chunks = sum(4 * math.exp(-(1.0 - 0.1 * i) / WINDOW_S) for i in range(10))
    assert loaded.folded_s_per_chunk == pytest.approx(excess * math.exp(-1.0 / WINDOW_S) / chunks)
    share = loaded.prefill_chunk_rate * loaded.folded_s_per_chunk
    probe = scheduler.route(request("probe", prompt=32), now=1.0)
    assert probe.predicted_tpot_ms is not None and probe.predicted_stretch_ms is not None
    unstretched = probe.predicted_tpot_ms - probe.predicted_stretch_ms
    assert probe.predicted_tpot_ms == pytest.approx(unstretched / (1 - share), rel=1e-6)


def test_until_enough_mixed_steps_arrive_the_share_is_forecast_from_the_prompts_compute() -> None:
    assert _worker(mixed_s=0.035, steps=MIN_FOLDED_STEPS - 1).worker_loads(1.0)[0].folded_s_per_chunk is None

    def stretch_ms(s: Scheduler) -> float:
        probe = s.route(request("probe", prompt=32), now=1.0)
        assert probe.predicted_stretch_ms is not None
        return probe.predicted_stretch_ms

    cheap, dear = _worker(mixed_s=0.020, steps=MIN_FOLDED_STEPS), _worker(mixed_s=0.040, steps=MIN_FOLDED_STEPS)
    assert stretch_ms(cheap) < stretch_ms(dear)  # the same prompts, priced by what the steps measured
    long_prompts = _worker(mixed_s=0.030, steps=MIN_FOLDED_STEPS, prompt=2048)
    short_prompts = _worker(mixed_s=0.030, steps=MIN_FOLDED_STEPS, prompt=200)
    # The same steps measured, over a quarter of the chunks: each costs 4x, and they come at a quarter the rate.
    short, long = (s.worker_loads(1.0)[0] for s in (short_prompts, long_prompts))
    assert short.folded_s_per_chunk == pytest.approx(4 * long.folded_s_per_chunk)
    assert short.prefill_chunk_rate * short.folded_s_per_chunk == pytest.approx(
        long.prefill_chunk_rate * long.folded_s_per_chunk)


def test_prompts_placed_on_an_idle_worker_are_not_counted_as_folded() -> None:
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=WINDOW_S))
    idle = snapshot("w", WorkerRole.BOTH, max_prefill_chunk=512)
    scheduler.register(idle, now=0.0)
    scheduler.route(request("alone", prompt=2048), now=0.0)  # nothing else decodes: a pure prefill
    mixed = [MixedSample(512, 512 * 512, 4, 4096, 0.030)] * MIN_FOLDED_STEPS
    scheduler.on_heartbeat(idle, mixed, [], now=0.5)
    assert scheduler.worker_loads(0.5)[0].folded_s_per_chunk is None  # steps, but no chunk they carried


def test_a_sliced_local_prompt_waits_one_measured_mixed_step_per_slice_for_its_first_token() -> None:
    chunked = snapshot("w", WorkerRole.BOTH, running_seqs=4, max_prefill_chunk=512)
    busy = load("w", WorkerRole.BOTH, batch=4, snapshot=chunked, folded_s_per_step=0.020)
    side = decode_side(request(prompt=2048), view([busy]), busy)
    long_prompt = evaluate(request(prompt=2048), view([busy]), busy, None)
    assert long_prompt.ttft_s == pytest.approx(4 * (side.running_step_s + 0.020))  # four 512-token slices
    assert sliced_prefill_s(busy, side, 512) is None  # one slice: one prefill and the step it shares
    unmeasured = load("w", WorkerRole.BOTH, batch=4, snapshot=chunked)
    assert sliced_prefill_s(unmeasured, side, 2048) is None  # no mixed step measured yet
    idle = load("w", WorkerRole.BOTH, snapshot=snapshot("w", WorkerRole.BOTH, max_prefill_chunk=512),
                folded_s_per_step=0.020)
    assert sliced_prefill_s(idle, decode_side(request(prompt=2048), view([idle]), idle), 2048) is None


def test_the_mean_mixed_step_is_the_excess_per_step_whatever_it_carried() -> None:
    folded = FoldedCost(time_constant_s=10.0, min_steps=2)
    folded.add_step(0.030, now=0.0)
    assert folded.per_step_s(now=0.0) is None
    folded.add_step(0.010, now=0.0)
    assert folded.per_step_s(now=0.0) == pytest.approx(0.020)
