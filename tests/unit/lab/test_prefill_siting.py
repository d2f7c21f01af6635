"""lab/experiments/prefill_siting.py in its --smoke mode (the replay simulator, 80 requests per rate, one
seed; simulated time, so the figures are the same on every machine): the cost-based siting keeps its
finding against the fixed threshold, and the table has a row per siting and rate."""

from __future__ import annotations

import pytest

from lab.experiments.prefill_siting import SITINGS, SLO_TARGET, SMOKE_RATES, SMOKE_REQUESTS, compare, main


def test_cost_based_siting_attains_at_least_the_threshold_at_every_rate_and_more_past_its_knee() -> None:
    rows = compare(SMOKE_RATES, SMOKE_REQUESTS, [0], SLO_TARGET)
    assert [(r.rate, r.siting) for r in rows] == [(rate, name) for rate in SMOKE_RATES for name in SITINGS]
    by_rate = {rate: {r.siting: r for r in rows if r.rate == rate} for rate in SMOKE_RATES}
    for rate, pair in by_rate.items():
        assert pair["cost"].attainment >= pair["threshold"].attainment, rate
        # the threshold sends every long prompt away; the cost model keeps some where the decode side is idle
        assert 0 < pair["cost"].remote_share < pair["threshold"].remote_share <= 1, rate
    assert by_rate[max(SMOKE_RATES)]["cost"].attainment > by_rate[max(SMOKE_RATES)]["threshold"].attainment


def test_the_smoke_run_prints_one_row_per_siting_and_rate(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--smoke"])
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["rate", "siting", "attainment", "remote", "TTFT", "p90", "TPOT", "p90"]
    assert [row.split()[:2] for row in rows] == [[f"{rate:g}", name] for rate in SMOKE_RATES for name in SITINGS]
