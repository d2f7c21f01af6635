"""Serving metrics from request records: pure functions, recomputed from the JSON by `--compare`.

Definitions (those of vLLM's benchmark_serving unless noted):
- TTFT: request send -> first SSE event carrying content (role-only chunks excluded).
- E2E latency: request send -> end of the stream (the `[DONE]` event).
- TPOT: (E2E - TTFT) / (output_tokens - 1), for requests with > 1 output token.
- ITL: gaps between consecutive content-bearing SSE chunks. Convention for a chunk carrying k > 1
  tokens (speculative decoding, server-side batching of tokens): it counts as one gap plus k - 1 zero
  gaps, so a request contributes output_tokens - 1 ITL samples and mean ITL ~ TPOT. Since only the
  total token count is known (from usage), the zeros are added per request as
  max(0, output_tokens - content_chunks) -- percentiles do not depend on where they sit.
  (vLLM records one gap per chunk and no zeros; the two agree whenever a chunk carries one token.)
- Percentiles: numpy's linear interpolation; latency statistics cover completed requests only.
- Throughput: completed requests / duration, output tokens / duration, (input + output) / duration,
  where duration = run start -> last request finished, and tokens are counted once, on the client.
  Input tokens are the server's usage.prompt_tokens, else the harness's own count.
- Goodput: requests that completed AND met every SLO given (TTFT <= X and TPOT <= Y; a request
  with one output token meets the TPOT SLO, as in vLLM), per second of duration. The fraction's
  denominator is every request attempted: rejected (429/503), failed, timed-out requests and skipped
  turns are misses, so a server cannot raise its goodput by dropping requests.
- Prefix-cache hit rate: sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens)
  over completed requests that report cached_tokens; None when none does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.records import ErrorKind, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class GoodputCriterion:
    """The latency targets a `baton bench` run's goodput counts requests against (either may be absent).
    The scheduler's own per-request targets are `scheduler.types.SLO`."""

    ttft_ms: float | None = None  # None: not part of the goodput criterion
    tpot_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > self.ttft_ms):
            return False
        tpot = request_tpot(r)
        return not (self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms)


def request_tpot(r: RequestRecord) -> float | None:
    if not r.ok or r.ttft is None or r.e2e is None or r.output_tokens <= 1:
        return None
    return (r.e2e - r.ttft) / (r.output_tokens - 1)


def request_itls(r: RequestRecord) -> list[float]:
    """The request's inter-token latencies under the k-token-chunk convention above."""
    if not r.ok:
        return []
    return list(r.chunk_gaps) + [0.0] * max(0, r.output_tokens - r.content_chunks)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 / min / max / std in milliseconds (None for no samples)."""
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {"mean": float(a.mean()), "std": float(a.std()),
                                    "min": float(a.min()), "max": float(a.max())}
    out |= {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}
    return out


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples in seconds, over completed requests (ITL pooled over all tokens)."""
    done = [r for r in records if r.ok]
    tpots = [t for r in done if (t := request_tpot(r)) is not None]
    return {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": tpots,
        "itl": [g for r in done for g in request_itls(r)],
        "e2e": [r.e2e for r in done if r.e2e is not None],
    }


def summarize(records: list[RequestRecord], duration: float, slo: GoodputCriterion) -> dict[str, Any]:
    """The run's summary: counts, errors, throughput, latency distributions, goodput, prefix cache."""
    done = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in records if slo.met(r))
    samples = latency_samples(records)
    return {
        "duration_s": duration,
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": error_counts(records),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "token_sources": dict(Counter(str(r.token_source) for r in done)),
        **{f"{name}_ms": distribution_ms(values) for name, values in samples.items()},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "good_requests": good,
        "goodput": good / duration,
        "goodput_fraction": good / len(records) if records else 0.0,
        "prefix_cache": prefix_cache(records),
    }


def error_counts(records: list[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(str(r.error) for r in records if not r.ok and r.error is not None).items()))


def prefix_cache(records: list[RequestRecord]) -> dict[str, Any]:
    rep = [r for r in records if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    cached, prompt = sum(r.cached_tokens or 0 for r in rep), sum(r.prompt_tokens or 0 for r in rep)
    return {"hit_rate": cached / prompt if prompt else None, "cached_tokens": cached,
            "prompt_tokens": prompt, "requests_reporting": len(rep)}


def window_summary(records: list[RequestRecord], start: float, end: float, slo: GoodputCriterion) -> dict[str, Any]:
    """Goodput of the requests SENT in [start, end) seconds of the run, per second of that window."""
    inside = [r for r in records if start <= r.send_time < end]
    good = sum(1 for r in inside if slo.met(r))
    span = max(end - start, 1e-9)
    return {"start_s": start, "end_s": end, "requests": len(inside), "good_requests": good,
            "goodput": good / span, "goodput_fraction": good / len(inside) if inside else None,
            "errors": error_counts(inside)}


def fault_windows(records: list[RequestRecord], duration: float, slo: GoodputCriterion,
                  kill_at: float, restart_at: float | None) -> dict[str, Any]:
    """Goodput before the kill, between kill and restart (or the end), and after the restart."""
    during_end = restart_at if restart_at is not None else duration
    out = {"before": window_summary(records, 0.0, kill_at, slo),
           "during": window_summary(records, kill_at, during_end, slo)}
    if restart_at is not None:
        out["after"] = window_summary(records, restart_at, max(duration, restart_at), slo)
    return out


def skipped_record(request_id: str, session_id: int, turn: int, send_time: float) -> RequestRecord:
    """A conversation turn never sent because an earlier turn failed: a miss, with its own error kind."""
    return RequestRecord(request_id, session_id, turn, send_time, prompt_len=0, max_tokens=0,
                         error=ErrorKind.SKIPPED, error_detail="an earlier turn of this conversation failed")
