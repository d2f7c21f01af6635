"""`baton profile`'s prefill fit finds the floor and the line above it where the data have a knee,
and no floor where they are a line."""

from __future__ import annotations

import pytest

from scheduler.calibration.points import DecodePoint, PrefillPoint
from scheduler.calibration.profile_fit import build_profile, fit_decode, fit_prefill
from scheduler.core.cost_model import WorkerProfile

SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


def test_a_floor_then_a_line_is_found_with_its_knee() -> None:
    truth = WorkerProfile(prefill_fixed_s=0.001, prefill_per_token_s=3e-5, prefill_per_token_sq_s=0.0,
                          prefill_floor_s=0.022)
    points = [PrefillPoint(n, 0) for n in SIZES]
    fit = fit_prefill(points, [truth.prefill_s(n) for n in SIZES])
    assert fit.floor_s == pytest.approx(0.022)
    assert fit.coefficients[0] + fit.coefficients[1] * 2048 + fit.coefficients[2] * 2048**2 == pytest.approx(
        truth.prefill_s(2048))
    assert max(abs(e) for e in fit.relative_errors) < 1e-6
    decode = fit_decode([DecodePoint(1, 64), DecodePoint(8, 64)], [0.009, 0.010])
    assert build_profile(fit, decode).prefill_floor_s == pytest.approx(0.022)


def test_the_measured_h100_table_fits_within_two_percent_where_the_line_was_off_26() -> None:
    # `baton profile`'s table on the 4xH100 host of docs/benchmarks.md ("Four GPUs"): new, cached, ms.
    table = [(16, 0, 22.01), (32, 0, 21.97), (64, 0, 21.72), (128, 0, 21.63), (256, 0, 21.99), (512, 0, 21.92),
             (1024, 0, 32.71), (2048, 0, 64.38), (512, 1024, 21.86), (256, 1536, 22.33)]
    fit = fit_prefill([PrefillPoint(n, c) for n, c, _ in table], [ms / 1e3 for *_, ms in table])
    assert fit.floor_s == pytest.approx(0.0219, abs=2e-4)
    assert max(abs(e) for e in fit.relative_errors) < 0.02


def test_data_on_a_line_get_no_floor() -> None:
    line = WorkerProfile(prefill_fixed_s=0.004, prefill_per_token_s=3e-5, prefill_per_token_sq_s=2e-9)
    points = [PrefillPoint(n, 0) for n in SIZES]
    fit = fit_prefill(points, [line.prefill_s(n) for n in SIZES])
    assert fit.floor_s == 0.0
    assert fit.coefficients == pytest.approx((0.004, 3e-5, 2e-9), rel=1e-6)


def test_the_report_prints_the_floor_only_when_there_is_one() -> None:
    from services.profiler.report import _coefficient_lines

    fit = fit_prefill([PrefillPoint(n, 0) for n in SIZES], [0.01] * len(SIZES))
    floored = WorkerProfile(prefill_fixed_s=0.001, prefill_per_token_s=3e-5, prefill_floor_s=0.022)
    assert _coefficient_lines(floored, fit, fit)[0].startswith("prefill step = max(22 ms, 1 ms + 30 us/token")
    assert _coefficient_lines(WorkerProfile(), fit, fit)[0].startswith("prefill step = 10 ms + ")
