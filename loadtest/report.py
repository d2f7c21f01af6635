"""The result file (JSON: config, per-request records, summary per run) and the console report.

One file holds one invocation: its config, and one entry per request rate of the sweep. Summaries are
written for convenience, but `load_result` recomputes them from the per-request records with
`metrics.summarize`, so a comparison never depends on the version of the code that wrote the file.
JSON has no infinity: a rate of inf is written as the string "inf", other non-finite floats as null.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from loadtest.metrics import GoodputCriterion, fault_windows, summarize
from loadtest.records import RequestRecord
from loadtest.runner import RunResult

SCHEMA = "baton.bench/1"


@dataclass
class BenchResult:
    """One result file: a label (for legends), the invocation's config, the SLO and its runs."""

    label: str
    config: dict[str, Any]
    slo: GoodputCriterion
    runs: list[RunResult]

    def summaries(self) -> list[dict[str, Any]]:
        return [run_summary(run, self.slo) for run in self.runs]


def run_summary(run: RunResult, slo: GoodputCriterion) -> dict[str, Any]:
    """`metrics.summarize` plus what only the run knows: unsent requests, faults, client loop lag."""
    summary = summarize(run.records, run.duration, slo)
    summary["not_sent"] = run.not_sent
    summary["client_loop_lag_ms"] = run.loop_lag_ms
    windows = {}
    for event in run.faults:
        if event["action"] != "kill" or event["actual_s"] is None:
            continue
        restart = next((e["actual_s"] for e in run.faults if e["action"] == "restart"
                        and e["target"] == event["target"] and e["planned_s"] > event["planned_s"]), None)
        windows[f"{event['target']}@{event['planned_s']:g}"] = fault_windows(
            run.records, run.duration, slo, event["actual_s"], restart)
    if windows:
        summary["fault_windows"] = windows
    return summary


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def to_document(result: BenchResult) -> dict[str, Any]:
    runs = []
    for run, summary in zip(result.runs, result.summaries(), strict=True):
        runs.append({"request_rate": _rate_json(run.request_rate), "arrivals": run.arrivals,
                     "max_concurrency": run.max_concurrency, "duration_s": run.duration,
                     "not_sent": run.not_sent, "faults": run.faults, "client_loop_lag_ms": run.loop_lag_ms,
                     "summary": summary, "requests": [r.to_json() for r in run.records]})
    return _json_safe({
        "schema": SCHEMA, "label": result.label,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"python": sys.version.split()[0], "platform": platform.platform()},
        "slo": {"ttft_ms": result.slo.ttft_ms, "tpot_ms": result.slo.tpot_ms},
        "config": result.config, "runs": runs,
    })


def write_result(result: BenchResult, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_document(result), indent=1, allow_nan=False) + "\n")


def load_result(path: str | Path, slo: GoodputCriterion | None = None) -> BenchResult:
    """Read a result file; `slo` overrides the stored one (to judge several runs by the same SLO)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a baton bench result (schema {doc.get('schema')!r}, want {SCHEMA!r})")
    runs = []
    for r in doc["runs"]:
        rate = math.inf if r["request_rate"] == "inf" else float(r["request_rate"])
        runs.append(RunResult(rate, r["arrivals"], r["max_concurrency"],
                              [RequestRecord.from_json(x) for x in r["requests"]], r["duration_s"],
                              r.get("not_sent", 0), r.get("faults", []), r.get("client_loop_lag_ms", {})))
    stored = doc.get("slo") or {}
    return BenchResult(doc.get("label") or Path(path).stem, doc.get("config", {}),
                       slo or GoodputCriterion(stored.get("ttft_ms"), stored.get("tpot_ms")), runs)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_summary(summary: dict[str, Any], title: str, out: TextIO | None = None) -> None:
    """A vLLM-style block of headline numbers, then the latency table."""
    out = out or sys.stdout
    slo = summary["slo"]
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"
    lag = summary.get("client_loop_lag_ms") or {}
    rows = [
        ("Requests (completed / failed / not sent)",
         f"{summary['completed']} / {summary['failed']} / {summary.get('not_sent', 0)}"),
        ("Errors by kind", errors),
        ("Duration (s)", _fmt(summary["duration_s"])),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _fmt(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(summary["total_token_throughput"])),
        (f"Goodput (req/s) [TTFT<={_fmt(slo['ttft_ms'], 0)}ms, TPOT<={_fmt(slo['tpot_ms'], 0)}ms]",
         f"{_fmt(summary['goodput'])} ({summary['good_requests']}/{summary['num_requests']} = "
         f"{summary['goodput_fraction']:.1%})"),
        ("Prefix cache hit rate", _fmt(summary["prefix_cache"]["hit_rate"], 3)),
        ("Output tokens counted by", ", ".join(f"{k}={v}" for k, v in summary["token_sources"].items()) or "-"),
        ("Client loop lag p99 / max (ms)", f"{_fmt(lag.get('p99'))} / {_fmt(lag.get('max'))}"),
    ]
    print(f"{f' {title} ':=^78}", file=out)
    for name, value in rows:
        print(f"{name:<48}{value:>30}", file=out)
    print(f"{'(ms)':<10}" + "".join(f"{k:>11}" for k in ("mean", "p50", "p90", "p99", "max")), file=out)
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = summary[f"{metric}_ms"]
        print(f"{metric.upper():<10}" + "".join(f"{_fmt(d[k]):>11}" for k in ("mean", "p50", "p90", "p99", "max")),
              file=out)
    for name, windows in summary.get("fault_windows", {}).items():
        parts = [f"{w}: {_fmt(v['goodput'])} req/s ({_fmt(v['goodput_fraction'], 3)})" for w, v in windows.items()]
        print(f"Fault {name} goodput -- " + "; ".join(parts), file=out)
    print("=" * 78, file=out)


def print_comparison(results: list[BenchResult], out: TextIO | None = None) -> None:
    """One line per (file, rate): the headline numbers side by side."""
    out = out or sys.stdout
    head = ["run", "rate", "done", "fail", "req/s", "out tok/s", "goodput", "good %", "TTFT p50", "TTFT p99",
            "TPOT p50", "TPOT p99", "ITL p99"]
    print("  ".join(f"{h:>10}" for h in head), file=out)
    for result in results:
        for run, s in zip(result.runs, result.summaries(), strict=True):
            cells = [result.label[:10], f"{run.request_rate:g}", s["completed"], s["failed"],
                     _fmt(s["request_throughput"]), _fmt(s["output_throughput"], 1), _fmt(s["goodput"]),
                     f"{s['goodput_fraction']:.1%}", _fmt(s["ttft_ms"]["p50"], 1), _fmt(s["ttft_ms"]["p99"], 1),
                     _fmt(s["tpot_ms"]["p50"], 1), _fmt(s["tpot_ms"]["p99"], 1), _fmt(s["itl_ms"]["p99"], 1)]
            print("  ".join(f"{c!s:>10}" for c in cells), file=out)
