"""The profile fit: non-negative least squares in relative error recovers the cost model's coefficients."""

from __future__ import annotations

import random

import pytest

from scheduler.calibration.points import DecodePoint, Measurements, PrefillPoint
from scheduler.calibration.profile_fit import (
    build_profile,
    fit_decode,
    fit_measurements,
    fit_nonnegative,
    fit_prefill,
    outliers,
)
from scheduler.core.cost_model import WorkerProfile
from services.profiler.grid import build_grid

TRUE = WorkerProfile(prefill_fixed_s=0.004, prefill_per_token_s=3e-5, prefill_per_token_sq_s=2e-9,
                     decode_fixed_s=0.008, decode_per_seq_s=1.5e-4, decode_per_context_token_s=4e-8)
GRID = build_grid(max_model_len=8192, max_num_seqs=64)


def _prefill_times(points: list[PrefillPoint], noise: float = 0.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [TRUE.prefill_s(p.new_tokens, p.cached_tokens) * (1 + rng.uniform(-noise, noise)) for p in points]


def _decode_times(points: list[DecodePoint], noise: float = 0.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [TRUE.decode_step_s(p.batch, p.context_tokens) * (1 + rng.uniform(-noise, noise)) for p in points]


def test_exact_prefill_times_give_back_the_true_coefficients():
    points = list(GRID.prefill)
    fit = fit_prefill(points, _prefill_times(points))
    assert fit.coefficients == pytest.approx(
        (TRUE.prefill_fixed_s, TRUE.prefill_per_token_s, TRUE.prefill_per_token_sq_s), rel=1e-6)
    assert max(abs(e) for e in fit.relative_errors) < 1e-9


def test_exact_decode_times_give_back_the_true_coefficients():
    points = list(GRID.decode)
    fit = fit_decode(points, _decode_times(points))
    assert fit.coefficients == pytest.approx(
        (TRUE.decode_fixed_s, TRUE.decode_per_seq_s, TRUE.decode_per_context_token_s), rel=1e-6)


def test_noisy_times_land_near_the_true_coefficients_with_small_relative_errors():
    points = list(GRID.prefill)
    fit = fit_prefill(points, _prefill_times(points, noise=0.05, seed=3))
    a, b, c = fit.coefficients
    assert a == pytest.approx(TRUE.prefill_fixed_s, rel=0.25)
    assert b == pytest.approx(TRUE.prefill_per_token_s, rel=0.25)
    assert c == pytest.approx(TRUE.prefill_per_token_sq_s, rel=0.25)
    assert max(abs(e) for e in fit.relative_errors) < 0.1


def test_a_cost_the_data_says_is_negative_is_clamped_to_zero_and_the_rest_refitted():
    # time = 1 + 2x - 0.5y: unconstrained least squares would answer y's cost as -0.5
    rows = [(1.0, float(x), float(y)) for x in range(1, 5) for y in range(0, 3)]
    times = [1 + 2 * x - 0.5 * y for _, x, y in rows]
    fit = fit_nonnegative(rows, times)
    assert all(c >= 0 for c in fit.coefficients)
    assert fit.coefficients[2] == 0.0
    assert fit.coefficients[1] > 0


def test_errors_are_relative_so_a_short_step_counts_as_much_as_a_long_one():
    # time = x * feature, one step 500x shorter than the other. An absolute-error fit would take
    # x = 1.000001 (fitting the long step) and leave the short one off by -50%; minimising relative
    # errors gives x = (0.5 + 1) / (0.5**2 + 1) = 1.2: -40% and +20%.
    fit = fit_nonnegative([(1.0,), (1000.0,)], [2.0, 1000.0])
    assert fit.coefficients[0] == pytest.approx(1.2)
    assert fit.relative_errors == pytest.approx((-0.4, 0.2))


def test_the_fitted_profile_keeps_default_transfer_terms_unless_given():
    points = list(GRID.prefill)
    prefill = fit_prefill(points, _prefill_times(points))
    decode = fit_decode(list(GRID.decode), _decode_times(list(GRID.decode)))
    assert build_profile(prefill, decode).transfer_fixed_s == WorkerProfile().transfer_fixed_s
    measured = build_profile(prefill, decode, transfer_fixed_s=0.001, transfer_per_token_s=3e-7)
    assert (measured.transfer_fixed_s, measured.transfer_per_token_s) == (0.001, 3e-7)


@pytest.mark.parametrize("rows, times, message", [
    ([], [], "one measured time per feature row"),
    ([(1.0, 2.0)], [1.0, 2.0], "one measured time per feature row"),
    ([(1.0, 2.0), (1.0,)], [1.0, 2.0], "same"),
    ([(1.0,)], [0.0], "positive and finite"),
])
def test_bad_fit_input_is_refused_with_the_reason(rows, times, message):
    with pytest.raises(ValueError, match=message):
        fit_nonnegative(rows, times)


def test_a_point_far_off_its_fit_is_named_as_an_outlier():
    points = list(GRID.prefill)
    times = _prefill_times(points)
    times[2] *= 3  # a neighbour slowed this step down
    decode = list(GRID.decode)
    measured = Measurements(tuple(zip(points, times, strict=True)),
                            tuple(zip(decode, _decode_times(decode), strict=True)))
    assert outliers(measured, fit_measurements(measured)) == [points[2]]
