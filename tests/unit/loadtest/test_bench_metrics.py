"""Metric definitions on hand-built request timelines (no network)."""

from __future__ import annotations

import pytest

from loadtest.metrics import (
    GoodputCriterion,
    distribution_ms,
    fault_windows,
    latency_samples,
    request_itls,
    request_tpot,
    summarize,
)
from loadtest.records import ErrorKind, RequestRecord, TokenSource


def done(rid: str, send: float, ttft: float, gaps: list[float], tokens: int | None = None, **kw) -> RequestRecord:
    """A completed request: first token at `ttft`, then one chunk per gap; e2e = last chunk."""
    chunks = len(gaps) + 1
    return RequestRecord(rid, 0, 0, send, prompt_len=kw.pop("prompt_len", 10), max_tokens=100, ok=True,
                         ttft=ttft, e2e=ttft + sum(gaps), chunk_gaps=gaps, content_chunks=chunks,
                         output_tokens=tokens if tokens is not None else chunks, token_source=TokenSource.USAGE,
                         **kw)


def failed(rid: str, send: float, kind: ErrorKind) -> RequestRecord:
    return RequestRecord(rid, 0, 0, send, prompt_len=10, max_tokens=100, error=kind, e2e=0.001)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    r = done("a", 0.0, ttft=0.1, gaps=[0.02, 0.03, 0.01, 0.04])  # 5 tokens, e2e 0.2
    assert request_tpot(r) == pytest.approx((0.2 - 0.1) / 4)


def test_tpot_undefined_for_one_token_and_for_failures() -> None:
    assert request_tpot(done("a", 0.0, 0.1, [])) is None
    assert request_tpot(failed("b", 0.0, ErrorKind.HTTP_503)) is None


def test_itl_counts_a_k_token_chunk_as_one_gap_and_k_minus_1_zeros() -> None:
    r = done("a", 0.0, ttft=0.1, gaps=[0.04, 0.04], tokens=6)  # 3 chunks of 2 tokens each
    itls = request_itls(r)
    assert sorted(itls) == [0.0, 0.0, 0.0, 0.04, 0.04]
    assert len(itls) == r.output_tokens - 1
    assert sum(itls) / len(itls) == pytest.approx(request_tpot(r))


def test_itl_is_the_chunk_gaps_when_each_chunk_is_one_token() -> None:
    assert request_itls(done("a", 0.0, 0.1, [0.02, 0.05])) == [0.02, 0.05]


def test_percentiles_use_linear_interpolation_in_ms() -> None:
    d = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert d["mean"] == pytest.approx(50.5)
    assert (d["min"], d["max"]) == (pytest.approx(1.0), pytest.approx(100.0))


def test_latency_statistics_cover_completed_requests_only() -> None:
    samples = latency_samples([done("a", 0, 0.1, [0.02]), failed("b", 0, ErrorKind.TIMEOUT)])
    assert samples["ttft"] == [0.1]
    assert samples["e2e"] == [pytest.approx(0.12)]


def test_goodput_needs_both_slos_and_counts_rejections_as_misses() -> None:
    records = [
        done("good1", 0.0, ttft=0.1, gaps=[0.02] * 9),
        done("good2", 0.5, ttft=0.2, gaps=[0.02] * 9),
        done("slow_first_token", 1.0, ttft=0.5, gaps=[0.02] * 9),
        done("slow_decode", 1.5, ttft=0.1, gaps=[0.08] * 9),
        failed("rejected", 1.8, ErrorKind.HTTP_429),
        failed("overloaded", 1.9, ErrorKind.HTTP_503),
    ]
    s = summarize(records, duration=4.0, slo=GoodputCriterion(ttft_ms=300, tpot_ms=50))
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["goodput_fraction"] == pytest.approx(2 / 6)
    assert s["errors"] == {"http_429": 1, "http_503": 1}
    assert (s["completed"], s["failed"]) == (4, 2)


def test_dropping_requests_cannot_raise_the_goodput_fraction() -> None:
    served = [done(f"r{i}", i * 0.1, 0.1, [0.02] * 4) for i in range(8)]
    slo = GoodputCriterion(ttft_ms=300, tpot_ms=50)
    all_served = summarize(served + [done("late", 1.0, 0.9, [0.02] * 4)], 2.0, slo)
    dropped = summarize(served + [failed("late", 1.0, ErrorKind.HTTP_503)], 2.0, slo)
    assert dropped["goodput_fraction"] == all_served["goodput_fraction"] == pytest.approx(8 / 9)
    assert dropped["goodput"] == all_served["goodput"]


def test_one_token_answer_meets_the_tpot_slo() -> None:
    assert GoodputCriterion(ttft_ms=300, tpot_ms=1).met(done("a", 0.0, 0.1, []))


def test_a_completed_request_without_any_content_misses_a_ttft_slo() -> None:
    r = done("a", 0.0, 0.1, [])
    r.ttft = None
    assert not GoodputCriterion(ttft_ms=300).met(r)
    assert GoodputCriterion(tpot_ms=300).met(r)


def test_throughput_counts_each_completed_token_once() -> None:
    records = [done("a", 0, 0.1, [0.01] * 9, prompt_tokens=100), done("b", 0, 0.1, [0.01] * 4, prompt_len=50),
               failed("c", 0, ErrorKind.DISCONNECT)]
    s = summarize(records, duration=2.0, slo=GoodputCriterion())
    assert s["total_output_tokens"] == 15
    assert s["total_input_tokens"] == 150  # server's usage.prompt_tokens when given, else the harness count
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_token_throughput"] == pytest.approx(82.5)
    assert s["request_throughput"] == pytest.approx(1.0)


def test_prefix_cache_hit_rate_from_cached_tokens() -> None:
    records = [done("a", 0, 0.1, [0.01], prompt_tokens=100, cached_tokens=0),
               done("b", 0, 0.1, [0.01], prompt_tokens=300, cached_tokens=200),
               done("c", 0, 0.1, [0.01], prompt_tokens=50)]  # no cached_tokens reported: not counted
    pc = summarize(records, 1.0, GoodputCriterion())["prefix_cache"]
    assert pc["hit_rate"] == pytest.approx(0.5)
    assert pc["requests_reporting"] == 2


def test_prefix_cache_hit_rate_is_none_when_the_server_reports_nothing() -> None:
    assert summarize([done("a", 0, 0.1, [0.01])], 1.0, GoodputCriterion())["prefix_cache"]["hit_rate"] is None


def test_fault_windows_split_by_send_time() -> None:
    slo = GoodputCriterion(ttft_ms=300)
    records = [done("b1", 0.5, 0.1, [0.01]), done("b2", 1.5, 0.1, [0.01]),
               failed("d1", 2.5, ErrorKind.CONNECT), done("d2", 3.5, 0.1, [0.01]),
               done("a1", 4.5, 0.1, [0.01]), done("a2", 5.5, 0.1, [0.01])]
    w = fault_windows(records, duration=6.0, slo=slo, kill_at=2.0, restart_at=4.0)
    assert (w["before"]["requests"], w["before"]["goodput_fraction"]) == (2, 1.0)
    assert (w["during"]["requests"], w["during"]["goodput_fraction"]) == (2, 0.5)
    assert w["during"]["goodput"] == pytest.approx(1 / 2.0)
    assert w["during"]["errors"] == {"connect": 1}
    assert (w["after"]["requests"], w["after"]["goodput"]) == (2, pytest.approx(1.0))
