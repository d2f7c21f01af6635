"""Per-run hand-off phase quantiles from scraped Prometheus histograms (lab/experiments/handoff_phases.py)."""

from __future__ import annotations

import math

from lab.experiments.handoff_phases import phase_summary, quantile

BUCKETS = {0.001: 2.0, 0.005: 8.0, 0.01: 10.0, math.inf: 10.0}


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    assert quantile(BUCKETS, 0.5) == 0.001 + 0.004 * (3 / 6)
    assert quantile(BUCKETS, 0.9) == 0.005 + 0.005 * 0.5
    assert quantile({0.001: 0.0, math.inf: 0.0}, 0.5) is None


def test_quantile_in_the_inf_bucket_reads_the_top_finite_bound() -> None:
    assert quantile({0.001: 1.0, 0.002: 1.0, math.inf: 4.0}, 0.9) == 0.002


def _scrape(n_fast: float, n_total: float, total_s: float) -> dict[str, float]:
    return {
        "baton_pd_handoff_phase_seconds_bucket{le=0.001,phase=overhead}": n_fast,
        "baton_pd_handoff_phase_seconds_bucket{le=+Inf,phase=overhead}": n_total,
        "baton_pd_handoff_phase_seconds_count{phase=overhead}": n_total,
        "baton_pd_handoff_phase_seconds_sum{phase=overhead}": total_s,
        "baton_kv_transfer_seconds_count{outcome=failed}": 3.0,
    }


def test_summary_is_of_the_run_only_and_skips_failed_writes() -> None:
    before = {"decode-0": _scrape(5.0, 5.0, 0.004)}
    after = {"decode-0": _scrape(6.0, 7.0, 0.010)}
    summary = phase_summary(before, after)
    assert summary == {"decode-0": {"overhead": {"count": 2, "mean_ms": 3.0, "p50_ms": 1.0, "p90_ms": 1.0,
                                                 "p99_ms": 1.0}}}
