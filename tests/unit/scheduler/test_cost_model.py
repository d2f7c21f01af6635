import json
import random
from dataclasses import asdict

import pytest

from scheduler.core.cost_model import MIN_OWN_SAMPLES, CostModel, WorkerProfile
from scheduler.types import DecodeSample, PrefillSample

TRUE = WorkerProfile(
    prefill_fixed_s=0.02,
    prefill_per_token_s=3e-4,
    prefill_per_token_sq_s=5e-8,
    decode_fixed_s=0.015,
    decode_per_seq_s=4e-4,
    decode_per_context_token_s=2e-7,
)


def test_predictions_are_the_profile_before_any_sample() -> None:
    model = CostModel(TRUE)
    assert model.prefill_s(1000) == pytest.approx(TRUE.prefill_s(1000))
    assert model.decode_step_s(32, 20_000) == pytest.approx(TRUE.decode_step_s(32, 20_000))
    assert model.fitted_profile() == TRUE


def test_prefill_fit_recovers_coefficients_from_noisy_samples() -> None:
    rng = random.Random(1)
    model = CostModel(WorkerProfile(), window=2000)  # seeded with the (wrong) defaults
    for _ in range(2000):
        tokens = rng.randint(16, 8192)
        model.observe(PrefillSample(tokens, TRUE.prefill_s(tokens) + rng.gauss(0, 0.002)))
    fitted = model.fitted_profile()
    assert fitted.prefill_fixed_s == pytest.approx(TRUE.prefill_fixed_s, rel=0.1)
    assert fitted.prefill_per_token_s == pytest.approx(TRUE.prefill_per_token_s, rel=0.02)
    assert fitted.prefill_per_token_sq_s == pytest.approx(TRUE.prefill_per_token_sq_s, rel=0.02)


def test_decode_fit_recovers_coefficients_from_noisy_samples() -> None:
    rng = random.Random(2)
    model = CostModel(WorkerProfile(), window=2000)
    for _ in range(2000):
        batch = rng.randint(1, 256)
        context = batch * rng.randint(100, 4000)
        model.observe(DecodeSample(batch, context, TRUE.decode_step_s(batch, context) * rng.gauss(1.0, 0.03)))
    fitted = model.fitted_profile()
    assert fitted.decode_fixed_s == pytest.approx(TRUE.decode_fixed_s, rel=0.1)
    assert fitted.decode_per_seq_s == pytest.approx(TRUE.decode_per_seq_s, rel=0.1)
    assert fitted.decode_per_context_token_s == pytest.approx(TRUE.decode_per_context_token_s, rel=0.05)


def test_batched_prefill_samples_fit_through_their_attention_term() -> None:
    rng = random.Random(3)
    model = CostModel(WorkerProfile(), window=1000)
    for _ in range(1000):
        prompts = [rng.randint(16, 2048) for _ in range(rng.randint(1, 4))]
        attention = sum(p * p for p in prompts)
        seconds = TRUE.prefill_fixed_s + TRUE.prefill_per_token_s * sum(prompts)
        seconds += TRUE.prefill_per_token_sq_s * attention
        model.observe(PrefillSample(sum(prompts), seconds, attention_tokens_sq=attention))
    assert model.prefill_s(4000) == pytest.approx(TRUE.prefill_s(4000), rel=0.01)


def test_window_tracks_a_worker_that_slows_down() -> None:
    model = CostModel(TRUE, window=200)
    for step in range(600):
        batch = 1 + step % 64
        slowdown = 1.0 if step < 300 else 2.0
        model.observe(DecodeSample(batch, batch * 1000, TRUE.decode_step_s(batch, batch * 1000) * slowdown))
    assert model.decode_step_s(32, 32_000) == pytest.approx(2 * TRUE.decode_step_s(32, 32_000), rel=0.02)


def test_fit_never_predicts_negative_or_zero_step_times() -> None:
    model = CostModel(WorkerProfile(), window=50)
    for _ in range(50):  # degenerate samples: one size, tiny times
        model.observe(PrefillSample(1000, 1e-6))
    assert model.prefill_s(1) > 0
    assert all(v >= 0 for v in asdict(model.fitted_profile()).values())


def test_prefill_with_cached_prefix_costs_less_than_uncached() -> None:
    model = CostModel(TRUE)
    assert model.prefill_s(100, cached_tokens=3900) < model.prefill_s(4000)


def test_profile_round_trips_through_json(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(TRUE.to_json())
    assert WorkerProfile.load(path) == TRUE


def test_profile_rejects_unknown_keys_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match="prefill_fixed_s"):
        WorkerProfile.from_json(json.dumps({"prefil_fixed_s": 0.1}))


def test_profile_rejects_negative_coefficients() -> None:
    with pytest.raises(ValueError, match="decode_per_seq_s"):
        WorkerProfile(decode_per_seq_s=-1.0)


def test_ttft_is_queue_ahead_plus_own_prefill_plus_transfer() -> None:
    model = CostModel(TRUE)
    ttft = model.predict_ttft_s(
        queued_tokens=2000, queued_requests=2, new_tokens=1000, cached_tokens=0, transfer_tokens=1000
    )
    queue_ahead = 2 * TRUE.prefill_s(1000)  # two queued prompts of 1000 tokens each
    assert ttft == pytest.approx(queue_ahead + TRUE.prefill_s(1000) + TRUE.transfer_s(1000))


def test_tpot_is_the_decode_step_with_the_request_added_at_mid_life() -> None:
    model = CostModel(TRUE)
    tpot = model.predict_tpot_s(batch=10, context_tokens=10_000, prompt_tokens=1000, max_tokens=200)
    assert tpot == pytest.approx(TRUE.decode_step_s(11, 10_000 + 1000 + 100))


# A CPU worker: batches of 1-8, steps of tens to hundreds of ms (SmolLM2-135M on one core).
CPU = WorkerProfile(
    prefill_fixed_s=0.05,
    prefill_per_token_s=3e-3,
    prefill_per_token_sq_s=0.0,
    decode_fixed_s=0.02,
    decode_per_seq_s=0.015,
    decode_per_context_token_s=1e-6,
)


def _cpu_samples(model: CostModel, rng: random.Random, count: int, slowdown: float = 1.0) -> None:
    for _ in range(count):
        batch = rng.randint(1, 8)
        context = batch * rng.randint(100, 2000)
        seconds = CPU.decode_step_s(batch, context) * slowdown * rng.gauss(1.0, 0.01)
        model.observe(DecodeSample(batch, context, seconds))
        tokens = rng.randint(32, 512)
        model.observe(PrefillSample(tokens, CPU.prefill_s(tokens) * slowdown * rng.gauss(1.0, 0.01)))


def test_cpu_sized_samples_move_the_fit_off_the_default_profile() -> None:
    model = CostModel(WorkerProfile(), window=512)  # the default profile is 10-100x off here
    _cpu_samples(model, random.Random(4), 300)
    fitted = model.fitted_profile()
    assert fitted.decode_fixed_s == pytest.approx(CPU.decode_fixed_s, rel=0.1)
    assert fitted.decode_per_seq_s == pytest.approx(CPU.decode_per_seq_s, rel=0.1)
    assert fitted.decode_per_context_token_s == pytest.approx(CPU.decode_per_context_token_s, rel=0.1)
    assert fitted.prefill_fixed_s == pytest.approx(CPU.prefill_fixed_s, rel=0.1)
    assert fitted.prefill_per_token_s == pytest.approx(CPU.prefill_per_token_s, rel=0.1)


def test_cpu_worker_that_slows_down_twofold_is_tracked_within_one_window() -> None:
    model = CostModel(WorkerProfile(), window=256)
    rng = random.Random(5)
    _cpu_samples(model, rng, 256)
    _cpu_samples(model, rng, 256, slowdown=2.0)  # one window of each kind (the fits have one each)
    assert model.decode_step_s(4, 4000) == pytest.approx(2 * CPU.decode_step_s(4, 4000), rel=0.05)
    assert model.prefill_s(256) == pytest.approx(2 * CPU.prefill_s(256), rel=0.05)


def test_a_batch_size_that_never_varies_is_predicted_from_its_samples() -> None:
    model = CostModel(WorkerProfile(), window=100)
    for _ in range(100):  # a worker with one slot: always batch 1
        model.observe(DecodeSample(1, 500, CPU.decode_step_s(1, 500)))
    assert model.decode_step_s(1, 500) == pytest.approx(CPU.decode_step_s(1, 500), rel=0.01)
    # Collinear with the fixed term: the ridge splits the sum, the data fix the prediction.
    assert model.fitted_profile().decode_fixed_s > WorkerProfile().decode_fixed_s


def test_a_worker_without_samples_predicts_from_its_models_pool_until_it_has_its_own() -> None:
    pool = CostModel(TRUE)
    newcomer = CostModel(TRUE, pool=pool)
    for _ in range(20):  # the fleet measured 80-ms decode steps (a CPU, not the profile's GPU)
        pool.observe(DecodeSample(batch_size=1, context_tokens=100, seconds=0.08))
    assert newcomer.decode_step_s(1, 100) == pytest.approx(0.08, rel=0.05)
    assert newcomer.prefill_s(100) == pytest.approx(TRUE.prefill_s(100))  # no prefill seen anywhere yet
    for _ in range(MIN_OWN_SAMPLES):  # its own steps are faster: once it has enough, they decide
        sample = DecodeSample(batch_size=1, context_tokens=100, seconds=0.04)
        newcomer.observe(sample)
        pool.observe(sample)
    assert newcomer.decode_step_s(1, 100) == pytest.approx(0.04, rel=0.05)


def test_a_worker_joining_a_pool_that_knows_more_predicts_from_it_at_once() -> None:
    pool = CostModel(TRUE)
    for _ in range(20):
        pool.observe(DecodeSample(batch_size=1, context_tokens=100, seconds=0.08))
    newcomer = CostModel(TRUE, pool=pool)  # registered after the fleet measured its steps
    assert newcomer.decode_step_s(1, 100) == pytest.approx(0.08, rel=0.05)


def test_a_refit_changes_no_prediction_and_a_new_sample_changes_the_next_one() -> None:
    lazy, eager = CostModel(TRUE), CostModel(TRUE)
    rng = random.Random(3)
    for _ in range(40):
        sample = PrefillSample(rng.randint(16, 2048), rng.uniform(0.05, 0.5))
        lazy.observe(sample)
        eager.observe(sample)
        eager.refit()
        assert lazy.prefill_s(512) == eager.prefill_s(512)  # read right after each sample: never stale
        assert lazy.prefill_backlog_s(4096, 3) == eager.prefill_backlog_s(4096, 3)


def _concave_cpu_steps(model: CostModel, batches: range) -> None:
    """The 2-core CPU's decode curve (docs/benchmarks.md): steep to 3 sequences, flat after."""
    step_ms = {1: 75, 2: 130, 3: 185, 4: 145, 5: 155, 6: 160, 7: 170, 8: 170}
    for _ in range(10):
        for batch in batches:
            model.observe(DecodeSample(batch, 0, step_ms[batch] / 1e3))


def test_a_batch_past_the_largest_seen_costs_the_step_there_plus_the_profiles_per_sequence_cost() -> None:
    profile = WorkerProfile(decode_per_seq_s=0.011, decode_per_context_token_s=0.0)
    model = CostModel(profile)
    _concave_cpu_steps(model, range(1, 4))  # batches 1-3 only: a line of ~55 ms per sequence
    at_three = model.decode_step_s(3, 0)
    assert model.decode_step_s(2, 0) < at_three  # inside the seen range: the fitted line
    assert model.decode_step_s(4, 0) == pytest.approx(at_three + 0.011)
    assert model.decode_step_s(6, 0) == pytest.approx(at_three + 3 * 0.011)
    line_at_four = 2 * at_three - model.decode_step_s(2, 0)
    assert line_at_four > 0.23  # what the line would have said: near the CPU runs' 250-ms TPOT target

    _concave_cpu_steps(model, range(1, 9))  # the worker ran 4-8 sequences: the line covers them now
    assert model.decode_step_s(8, 0) < line_at_four


def test_a_batch_size_counts_as_seen_after_a_few_steps_and_stops_when_they_leave_the_window() -> None:
    model = CostModel(WorkerProfile(decode_per_context_token_s=0.0), window=20)
    for _ in range(20):
        model.observe(DecodeSample(2, 0, 0.1))
    model.observe(DecodeSample(6, 0, 0.3))  # one step at 6 sequences: not yet a size the fit has seen
    assert model.decode_step_s(6, 0) == pytest.approx(model.decode_step_s(2, 0) + 4 * WorkerProfile().decode_per_seq_s)
    model.observe(DecodeSample(6, 0, 0.3))
    model.observe(DecodeSample(6, 0, 0.3))
    assert model.decode_step_s(6, 0) > 0.25  # three steps: the line through 2 and 6
    for _ in range(20):  # the window moves on to batch-2 steps only
        model.observe(DecodeSample(2, 0, 0.1))
    assert model.decode_step_s(6, 0) == pytest.approx(0.1 + 4 * WorkerProfile().decode_per_seq_s, rel=0.01)


def test_the_steps_at_a_batch_size_correct_the_line_where_the_curve_is_not_one() -> None:
    """The CPU's concave decode curve: a line through 1-8 sequences misprices most sizes by 10-25%;
    each size's own steps bring its prediction back to what it costs."""
    model = CostModel(WorkerProfile(decode_per_context_token_s=0.0))
    step_ms = {1: 75, 2: 130, 3: 185, 4: 145, 5: 155, 6: 160, 7: 170, 8: 170}
    for _ in range(30):
        for batch, ms in step_ms.items():
            model.observe(DecodeSample(batch, 0, ms / 1e3))
    d, e = _decode_line(model)
    for batch in (1, 3):  # the line alone is far off there
        assert abs(d + batch * e - step_ms[batch] / 1e3) > 0.15 * step_ms[batch] / 1e3
    for batch, ms in step_ms.items():  # 30 samples each keep 30/33 of their residual
        assert model.decode_step_s(batch, 0) == pytest.approx(ms / 1e3, abs=0.1 * abs(d + batch * e - ms / 1e3) + 1e-6)


def test_a_batch_size_seen_once_moves_its_prediction_a_quarter_of_the_way() -> None:
    model = CostModel(WorkerProfile(decode_per_context_token_s=0.0))
    for _ in range(50):
        for batch in (2, 4):
            model.observe(DecodeSample(batch, 0, 0.05 * batch))  # a line: 50 ms per sequence
    assert model.decode_step_s(3, 0) == pytest.approx(0.15, rel=1e-3)
    model.observe(DecodeSample(3, 0, 0.35))  # one slow step at 3 (a noisy neighbour, say)
    d, e = _decode_line(model)
    line = d + 3 * e
    assert model.decode_step_s(3, 0) == pytest.approx(line + (0.35 - line) / 4, rel=1e-3)


def test_between_and_beside_the_sizes_seen_the_correction_is_interpolated_or_the_nearest() -> None:
    model = CostModel(WorkerProfile(decode_per_context_token_s=0.0, decode_per_seq_s=0.0))
    for _ in range(40):
        for batch, seconds in ((2, 0.10), (4, 0.30), (6, 0.30)):
            model.observe(DecodeSample(batch, 0, seconds))
    d, e = _decode_line(model)

    def residual(batch: int) -> float:
        return model.decode_step_s(batch, 0) - (d + batch * e)

    assert residual(3) == pytest.approx((residual(2) + residual(4)) / 2)
    assert residual(1) == pytest.approx(residual(2))  # below the smallest size seen: its correction
    assert model.decode_step_s(9, 0) == pytest.approx(model.decode_step_s(6, 0))  # past the largest: the step there


def test_a_linear_worker_gets_no_correction_and_context_still_counts() -> None:
    rng = random.Random(7)
    model = CostModel(WorkerProfile(), window=2000)
    for _ in range(2000):
        batch, context = rng.randint(1, 64), rng.randint(0, 200_000)
        model.observe(DecodeSample(batch, context, TRUE.decode_step_s(batch, context)))
    for batch, context in ((1, 1000), (32, 100_000), (64, 190_000)):
        assert model.decode_step_s(batch, context) == pytest.approx(TRUE.decode_step_s(batch, context), rel=0.01)


def _decode_line(model: CostModel) -> tuple[float, float]:
    fitted = model.fitted_profile()
    return fitted.decode_fixed_s, fitted.decode_per_seq_s


def test_context_past_the_largest_in_the_window_costs_the_profiles_per_token_cost() -> None:
    """A worker's first steps: one sequence over a few tokens of context, its steps slowing from 62
    to 82 ms as another worker on the same cores starts (the CPU policy runs). The fit reads that
    as ~0.8 ms per context token (d pinned at 0); a batch of three at 270 tokens must not be priced at that slope."""
    profile = WorkerProfile(decode_per_seq_s=2e-4, decode_per_context_token_s=5e-8)
    model = CostModel(profile)
    for i, context in enumerate(range(82, 92)):
        model.observe(DecodeSample(1, context, 0.062 + 0.002 * i))
    assert model.fitted_profile().decode_per_context_token_s > 5e-4  # the drift, read as context
    at_seen = model.decode_step_s(1, 91)
    assert 0.062 < at_seen < 0.080  # within the steps measured there
    assert model.decode_step_s(3, 270) == pytest.approx(at_seen + 2 * 2e-4 + (270 - 91) * 5e-8)
    assert model.decode_step_s(1, 60) < at_seen  # below the range: the fitted line, as before


def test_longer_contexts_once_seen_are_priced_by_the_fit_until_they_leave_the_window() -> None:
    true = WorkerProfile(decode_fixed_s=0.02, decode_per_seq_s=1e-3, decode_per_context_token_s=2e-5)
    model = CostModel(WorkerProfile(), window=40)
    rng = random.Random(7)
    for _ in range(40):
        batch, context = rng.randint(1, 8), rng.randint(100, 4000)
        model.observe(DecodeSample(batch, context, true.decode_step_s(batch, context)))
    assert model.decode_step_s(4, 3000) == pytest.approx(true.decode_step_s(4, 3000), rel=0.02)
    for _ in range(40):  # the window moves on to short contexts only
        batch, context = rng.randint(1, 8), rng.randint(100, 500)
        model.observe(DecodeSample(batch, context, true.decode_step_s(batch, context)))
    fitted_at_500 = model.decode_step_s(4, 500)
    expected = fitted_at_500 + (3000 - 500) * WorkerProfile().decode_per_context_token_s
    assert model.decode_step_s(4, 3000) == pytest.approx(expected, rel=0.02)
