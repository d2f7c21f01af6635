"""Arrival processes and the runner's pacing: rates, burstiness, concurrency caps, deadlines."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from bench_fakes import FakeClient

from loadtest.arrivals import GammaArrivals, ImmediateArrivals, make_arrivals, parse_rate
from loadtest.records import Session, Turn
from loadtest.runner import BenchRunner, RunConfig

N = 20_000


def gaps(process, seed: int = 0) -> list[float]:  # noqa: ANN001
    times = process.schedule(N, random.Random(seed))
    return [b - a for a, b in zip([0.0] + times[:-1], times, strict=True)]


def sessions(n: int, turns: int = 1) -> list[Session]:
    turn = Turn(({"role": "user", "content": "hi"},), prompt_len=1, output_len=3)
    return [Session(i, (turn,) * turns) for i in range(n)]


def test_poisson_mean_rate_within_tolerance() -> None:
    times = GammaArrivals(rate=8.0).schedule(N, random.Random(1))
    assert N / times[-1] == pytest.approx(8.0, rel=0.03)


def test_poisson_gaps_have_unit_coefficient_of_variation() -> None:
    g = gaps(GammaArrivals(rate=8.0))
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_changes_variance_not_rate(burstiness: float) -> None:
    g = gaps(GammaArrivals(rate=8.0, burstiness=burstiness))
    assert statistics.mean(g) == pytest.approx(1 / 8.0, rel=0.05)
    cv2 = statistics.variance(g) / statistics.mean(g) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # gamma(k): CV^2 = 1/k; Poisson is k = 1


def test_schedule_is_reproducible_from_the_seed() -> None:
    p = GammaArrivals(rate=2.0, burstiness=0.5)
    assert p.schedule(50, random.Random(7)) == p.schedule(50, random.Random(7))
    assert p.schedule(50, random.Random(7)) != p.schedule(50, random.Random(8))


def test_infinite_rate_sends_everything_at_once() -> None:
    assert make_arrivals(math.inf) == ImmediateArrivals()
    assert ImmediateArrivals().schedule(5, random.Random(0)) == [0.0] * 5


@pytest.mark.parametrize("text", ["0", "-1", "nan", "fast"])
def test_invalid_rates_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


async def test_fixed_concurrency_never_exceeds_the_cap() -> None:
    client = FakeClient(delay_s=0.01)
    result = await BenchRunner(client, RunConfig(math.inf, max_concurrency=3, progress=False)).run(sessions(24))
    assert client.max_in_flight == 3
    assert len(result.records) == 24 and all(r.ok for r in result.records)


async def test_open_loop_paces_sends_at_the_offered_rate() -> None:
    client = FakeClient(delay_s=0.001)
    result = await BenchRunner(client, RunConfig(100.0, seed=3, progress=False)).run(sessions(40))
    expected = GammaArrivals(100.0).schedule(40, random.Random(3))
    lateness = [a - b for a, b in zip(sorted(r.send_time for r in result.records), expected, strict=True)]
    assert min(lateness) >= -0.001  # never early (up to the event loop clock resolution)
    assert statistics.median(lateness) < 0.005 and max(lateness) < 0.1  # on time (a shared CPU may hiccup)


async def test_max_duration_stops_sending_and_counts_the_rest_as_not_sent() -> None:
    client = FakeClient(delay_s=0.05)
    runner = BenchRunner(client, RunConfig(math.inf, max_concurrency=1, max_duration=0.12, progress=False))
    result = await runner.run(sessions(20))
    assert 2 <= len(result.records) <= 4
    assert result.not_sent == 20 - len(result.records)
