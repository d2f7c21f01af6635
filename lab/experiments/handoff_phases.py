"""Per-run KV hand-off phases from the workers' `baton_pd_handoff_phase_seconds` and
`baton_kv_transfer_seconds` histograms: scrape before and after a run, subtract, and read count, mean
and quantiles (linear within a bucket, as Prometheus' histogram_quantile does) per worker and phase.

Phases (services/worker/metrics.py HandoffPhase): prefill worker queue_wait, prefill_compute,
write_after_prefill, prefill_job; decode worker reserve, notice_wait, notice_to_commit, handoff and
overhead (handoff minus the
prefill worker's queue wait + compute: what disaggregation adds to TTFT); `write` is the prefill
worker's WRITE posted -> done.
"""

from __future__ import annotations

import math
import re
import urllib.request
from typing import Any

PHASE_PREFIXES = ("baton_pd_handoff_phase_seconds", "baton_kv_transfer_seconds")
_KEY = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\}$")


def scrape(url: str, prefixes: tuple[str, ...] = PHASE_PREFIXES, buckets: bool = True) -> dict[str, float]:
    """One process's samples (histogram buckets too with `buckets`) whose name starts with one of
    `prefixes`, keyed `name{label=value,...}` with labels sorted, the way `Cluster.worker_counters` keys
    them. Raises OSError when the endpoint cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    skip = ("_created",) if buckets else ("_created", "_bucket")
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefixes) and not sample.name.endswith(skip):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def phase_summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
                  quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, dict[str, dict[str, Any]]]:
    """{worker: {phase: {count, mean_ms, p50_ms, ...}}} of what happened between the two scrapes."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for worker, samples in after.items():
        delta = {k: v - before.get(worker, {}).get(k, 0.0) for k, v in samples.items() if isinstance(v, float)}
        phases = _histograms(delta)
        summary = {phase: describe(h, quantiles) for phase, h in phases.items() if h["count"] > 0}
        if summary:
            out[worker] = summary
    return out


def _histograms(delta: dict[str, float]) -> dict[str, dict[str, Any]]:
    hists: dict[str, dict[str, Any]] = {}
    for key, value in delta.items():
        m = _KEY.match(key)
        name, labels = (m["name"], dict(p.split("=", 1) for p in m["labels"].split(","))) if m else (key, {})
        if name.startswith("baton_kv_transfer_seconds"):
            if labels.get("outcome") != "done":
                continue
            phase = "write"
        elif name.startswith("baton_pd_handoff_phase_seconds") and "phase" in labels:
            phase = labels["phase"]
        else:
            continue
        h = hists.setdefault(phase, {"count": 0.0, "sum": 0.0, "buckets": {}})
        if name.endswith("_count"):
            h["count"] = value
        elif name.endswith("_sum"):
            h["sum"] = value
        elif name.endswith("_bucket"):
            h["buckets"][float(labels["le"])] = value
    return hists


def describe(h: dict[str, Any], quantiles: tuple[float, ...]) -> dict[str, Any]:
    """A histogram delta ({count, sum, buckets}) as count, mean and quantiles in ms."""
    row: dict[str, Any] = {"count": int(h["count"]), "mean_ms": round(h["sum"] / h["count"] * 1e3, 3)}
    for q in quantiles:
        value = quantile(h["buckets"], q)
        row[f"p{round(q * 100):d}_ms"] = None if value is None else round(value * 1e3, 3)
    return row


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile of a cumulative histogram {upper bound: count}, linear inside the bucket; the
    top finite bound when it falls in the +Inf bucket; None when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = upper, count
    return lower
