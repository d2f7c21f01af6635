"""Prometheus metrics of the safety service (`baton_safety_*`), defined once per process."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.safety.limits import LATENCY_BUCKETS_S

# Tier latencies are microseconds to a few milliseconds: buckets from 5 us to 50 ms.
_TIER_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2)

VERDICTS = Counter(
    "baton_safety_verdicts", "Safety verdicts (input: per prompt; output: per halt/flag and per clean stream)",
    ["direction", "outcome", "category", "tier"],
)
TIER_LATENCY = Histogram(
    "baton_safety_tier_latency_seconds", "Time one tier spends on one text (normalisation included)",
    ["tier"], buckets=_TIER_BUCKETS,
)
RPC_LATENCY = Histogram(
    "baton_safety_rpc_latency_seconds", "Server-side time per CheckInput call or per FilterOutput chunk",
    ["method"], buckets=_TIER_BUCKETS,
)
INPUT_CHECK_SECONDS = Histogram(
    "baton_safety_input_check_seconds", "Server-side time of one CheckInput call, by the text's size "
    "(limits.SIZE_BUCKETS: le_100_words, le_1k_words, le_5k_words, le_max)", ["size"], buckets=LATENCY_BUCKETS_S,
)
ACTIVE_STREAMS = Gauge("baton_safety_active_streams", "FilterOutput streams currently open")


def record_verdict(direction: str, allowed: bool, category: str | None, tier: str) -> None:
    outcome = "blocked" if not allowed else ("flagged" if category else "allowed")
    VERDICTS.labels(direction, outcome, category or "none", tier).inc()
