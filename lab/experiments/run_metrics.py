"""Per-run service metrics: what the scheduler, the gateway and the workers' engines did during one run.

TTFT that grows with load can come from the scheduler (requests it queued, or a stalled event loop:
the gateway then waits out its 200 ms call timeout), from the gateway's own loop, or from the engine
(longer or more frequent prefill/mixed steps). A run's records alone cannot tell these apart, so the
suite scrapes these histograms and counters before and after each run and keeps the difference:

- scheduler: `baton_scheduler_queue_wait_seconds`, `baton_scheduler_decisions` (by kind and reason),
  `baton_scheduler_prefill_sites` (local or remote, by reason), `baton_scheduler_event_loop_lag_seconds`,
  `baton_scheduler_event_loop_cpu_seconds`,
  `baton_scheduler_gc_pause_seconds`;
- gateway: `baton_gateway_ttft_seconds`, `baton_gateway_event_loop_lag_seconds`,
  `baton_gateway_gc_pause_seconds`, and what its loop cost per request and token
  (`baton_gateway_event_loop_cpu_seconds`, `baton_gateway_tokens`, `baton_gateway_generations_finished`:
  lab/experiments/gateway_cost.py);
- each worker: `baton_engine_step_seconds` (the forward pass) and `baton_engine_served_step_seconds`
  (the engine loop's time per step) by kind of step (prefill, decode, mixed), and a decode worker's
  `baton_pd_prefill_path` (prompts prefilled locally or handed over).

Histograms come out as count, mean and quantiles (linear in a bucket, as in handoff_phases.py);
counters as their increase.
"""

from __future__ import annotations

import re
from typing import Any

from lab.experiments.handoff_phases import describe

SERVICE_PREFIXES = (
    "baton_scheduler_queue_wait_seconds", "baton_scheduler_decisions", "baton_scheduler_prefill_sites",
    "baton_scheduler_event_loop_lag_seconds", "baton_scheduler_event_loop_cpu_seconds",
    "baton_scheduler_gc_pause_seconds", "baton_gateway_ttft_seconds", "baton_gateway_event_loop_lag_seconds",
    "baton_gateway_event_loop_cpu_seconds", "baton_gateway_tokens", "baton_gateway_generations_finished",
    "baton_gateway_gc_pause_seconds", "baton_gateway_worker_messages",
)
WORKER_PREFIXES = ("baton_engine_step_seconds", "baton_engine_served_step_seconds", "baton_pd_prefill_path")
_KEY = re.compile(r"^(?P<name>[a-z_]+)(\{(?P<labels>[^}]*)\})?$")
_HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def run_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
              quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, dict[str, Any]]:
    """{process: {series: summary}} of what happened between two scrapes. A series is a histogram
    (`name{labels}` without `le`: {count, mean_ms, p50_ms, ...}) or a counter (`name{labels}`: its increase)."""
    out: dict[str, dict[str, Any]] = {}
    for process, samples in after.items():
        old = before.get(process, {})
        delta = {k: v - old.get(k, 0.0) for k, v in samples.items() if isinstance(v, float)}
        series = _summaries(delta, quantiles)
        if series:
            out[process] = series
    return out


def _summaries(delta: dict[str, float], quantiles: tuple[float, ...]) -> dict[str, Any]:
    histograms: dict[str, dict[str, Any]] = {}
    counters: dict[str, float] = {}
    for key, value in delta.items():
        m = _KEY.match(key)
        if m is None:
            continue
        name = m["name"]
        labels = dict(p.split("=", 1) for p in m["labels"].split(",")) if m["labels"] else {}
        part = next((p for p in _HISTOGRAM_PARTS if name.endswith(p)), None)
        if part is None:
            if value:
                counters[_series(name, labels)] = value
            continue
        bound = labels.pop("le", None)
        h = histograms.setdefault(_series(name.removesuffix(part), labels), {"count": 0.0, "sum": 0.0, "buckets": {}})
        if part == "_bucket" and bound is not None:
            h["buckets"][float(bound)] = value
        else:
            h[part.removeprefix("_")] = value
    out: dict[str, Any] = {k: round(v, 3) for k, v in sorted(counters.items())}
    out.update({series: describe(h, quantiles) for series, h in sorted(histograms.items()) if h["count"] > 0})
    return out


def _series(name: str, labels: dict[str, str]) -> str:
    return f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}" if labels else name
