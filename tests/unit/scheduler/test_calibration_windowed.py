import random

from scheduler.calibration.windowed import WindowedLeastSquares


def test_the_largest_bounded_value_is_the_windows_maximum_as_samples_come_and_go() -> None:
    rng = random.Random(5)
    fit = WindowedLeastSquares((0.0, 0.0), window=7, prior_weight=0.1, bounded=1)
    assert fit.largest_bounded() is None
    values: list[float] = []
    for _ in range(200):
        value = float(rng.choice([rng.randint(0, 50), rng.randint(0, 500)]))
        fit.add((1.0, value), 0.01 * value)
        values.append(value)
        assert fit.largest_bounded() == max(values[-7:])


def test_a_fit_without_a_bounded_feature_reports_none() -> None:
    fit = WindowedLeastSquares((0.0, 0.0), window=4, prior_weight=0.1)
    fit.add((1.0, 3.0), 0.3)
    assert fit.largest_bounded() is None
