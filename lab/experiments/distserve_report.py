"""The DistServe experiment's summary and plots, from its per-run `baton bench` result files.

A run file is `<config>__<workload>__r<rate>.json` (one rate each). Per workload and rate: SLO
attainment (the fraction of requests with TTFT <= the TTFT SLO and TPOT <= the TPOT SLO; failed and
timed-out requests are misses), goodput (such requests per second), TTFT/TPOT p90, and the ratio
disaggregated / co-located. DistServe's "goodput" of a configuration is the highest rate whose
attainment is >= 90%: reported as the highest such rate tested, and linearly interpolated to the
90% crossing between the last passing and the first failing rate; per GPU it is divided by the GPUs
the layout uses (its workers x `tp`). The ranking orders every layout by that per-GPU goodput, with
each one's share of the best.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lab.experiments.layouts import layout_gpus, parse_layout
from loadtest.metrics import GoodputCriterion
from loadtest.report import BenchResult, load_result

ATTAINMENT_TARGET = 0.9


def run_files(runs_dir: Path) -> dict[tuple[str, str], list[Path]]:
    """(config, workload) -> its run files, by rate."""
    out: dict[tuple[str, str], list[tuple[float, Path]]] = {}
    for path in runs_dir.glob("*__*__r*.json"):
        config, workload, rate = path.stem.split("__")
        out.setdefault((config, workload), []).append((float(rate[1:]), path))
    return {k: [p for _, p in sorted(v)] for k, v in out.items()}


def merged(paths: list[Path], label: str, slo: GoodputCriterion | None = None) -> BenchResult:
    """One BenchResult holding every rate's run (each file holds one); `slo` overrides the stored one."""
    results = [load_result(p, slo) for p in paths]
    return BenchResult(label, results[0].config, results[0].slo, [r for res in results for r in res.runs])


def _row(run_summary: dict[str, Any], rate: float) -> dict[str, Any]:
    s = run_summary
    return {"rate": rate, "requests": s["num_requests"], "completed": s["completed"], "failed": s["failed"],
            "errors": s["errors"], "attainment": s["goodput_fraction"], "goodput_rps": s["goodput"],
            "throughput_rps": s["request_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
            "itl_p90_ms": s["itl_ms"]["p90"], "mean_prompt_tokens": s["total_input_tokens"] / max(1, s["completed"]),
            "mean_output_tokens": s["total_output_tokens"] / max(1, s["completed"]),
            "duration_s": s["duration_s"], "client_loop_lag_p99_ms": (s.get("client_loop_lag_ms") or {}).get("p99")}


def distserve_goodput(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Highest tested rate with attainment >= 90%, and the interpolated 90% crossing."""
    rows = sorted(rows, key=lambda r: r["rate"])
    best, crossing, censored = None, None, False
    for i, row in enumerate(rows):
        if row["attainment"] >= ATTAINMENT_TARGET:
            best = row["rate"]
            continue
        if i > 0:  # the lowest rate failing already: below the sweep, no crossing to report
            prev = rows[i - 1]
            span = prev["attainment"] - row["attainment"]
            frac = (prev["attainment"] - ATTAINMENT_TARGET) / span if span > 0 else 0.0
            crossing = prev["rate"] + frac * (row["rate"] - prev["rate"])
        break
    else:
        censored = bool(rows)  # every tested rate passed: the real goodput is at least the top rate
        crossing = rows[-1]["rate"] if rows else None
    return {"max_rate_meeting_90pct": best, "interpolated_90pct_rate": crossing,
            "censored_at_top_rate": censored}


def summarize(runs_dir: Path, meta: dict[str, Any], slo: GoodputCriterion | None = None) -> dict[str, Any]:
    """Attainment and goodput per workload and configuration; judged by `slo` when given (the same
    per-request records under another SLO, e.g. a tight TPOT), else by the SLO the runs had."""
    files = run_files(runs_dir)
    per: dict[str, dict[str, list[dict[str, Any]]]] = {}
    if slo is not None:
        meta = {**meta, "slo": {**meta.get("slo", {}), "ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}}
    for (config, workload), paths in files.items():
        result = merged(paths, config, slo)
        per.setdefault(workload, {})[config] = [_row(s, run.request_rate)
                                                for run, s in zip(result.runs, result.summaries(), strict=True)]
    workloads: dict[str, Any] = {}
    for workload, configs in sorted(per.items()):
        entry: dict[str, Any] = {"configs": configs, "goodput": {}, "ratio_by_rate": []}
        for config, rows in configs.items():
            g = distserve_goodput(rows)
            gpus = meta.get("layout_gpus", {}).get(config) or layout_gpus(config, meta.get("tp", 1))
            g["gpus"] = gpus
            g["per_gpu"] = None if g["interpolated_90pct_rate"] is None else g["interpolated_90pct_rate"] / gpus
            entry["goodput"][config] = g
        entry["ranking"] = ranking(entry["goodput"])
        d_rows = {r["rate"]: r for r in configs.get("disagg", [])}
        c_rows = {r["rate"]: r for r in configs.get("colocated", [])}
        for rate in sorted(set(d_rows) & set(c_rows)):
            d, c = d_rows[rate], c_rows[rate]
            entry["ratio_by_rate"].append({
                "rate": rate, "goodput_disagg": d["goodput_rps"], "goodput_colocated": c["goodput_rps"],
                "goodput_ratio": _ratio(d["goodput_rps"], c["goodput_rps"]),
                "attainment_disagg": d["attainment"], "attainment_colocated": c["attainment"]})
        gd, gc = entry["goodput"].get("disagg"), entry["goodput"].get("colocated")
        if gd and gc:
            entry["distserve_goodput_ratio"] = _ratio(gd["interpolated_90pct_rate"], gc["interpolated_90pct_rate"])
            entry["distserve_per_gpu_goodput_ratio"] = _ratio(gd["per_gpu"], gc["per_gpu"])
            entry["ratio_is_bound"] = gd["censored_at_top_rate"] or gc["censored_at_top_rate"]
        workloads[workload] = entry
    return {**meta, "workloads": workloads}


def ranking(goodput: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Layouts by per-GPU goodput, best first, each with its share of the best (a bound where censored)."""
    known = sorted(((g["per_gpu"], config, g) for config, g in goodput.items() if g["per_gpu"] is not None),
                   key=lambda t: -t[0])
    best = known[0][0] if known else None
    return [{"config": config, "per_gpu": per_gpu, "of_best": _ratio(per_gpu, best),
             "censored": g["censored_at_top_rate"]} for per_gpu, config, g in known]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def plot(runs_dir: Path, out_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """goodput_<workload>.png (the harness's 4-panel comparison) and attainment_<workload>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loadtest.plots import plot_results

    written = []
    files = run_files(runs_dir)
    setup = _setup(summary)
    for workload, entry in summary["workloads"].items():
        results = [merged(files[(c, workload)], f"{c} ({setup})") for c in entry["configs"]
                   if (c, workload) in files]
        written.append(plot_results(results, out_dir / f"goodput_{workload}.png"))
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for config, rows in entry["configs"].items():
            rows = sorted(rows, key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rows], [100 * r["attainment"] for r in rows], marker="o", label=config)
        ax.axhline(100 * ATTAINMENT_TARGET, color="red", ls="--", lw=1, label="90% target")
        slo = summary.get("slo", {})
        ax.set_title(f"{workload}, {setup}: SLO attainment\n(TTFT<={slo.get('ttft_ms'):g}ms, "
                     f"TPOT<={slo.get('tpot_ms'):g}ms)", fontsize=10)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("requests meeting both SLOs (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"attainment_{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _setup(summary: dict[str, Any]) -> str:
    """E.g. 'Llama-3.1-70B-dummy, TP=2: 2 GPUs/worker'."""
    tp = summary.get("tp", 1)
    if summary.get("smoke"):
        return f"{summary.get('model')}, CPU"
    return f"{summary.get('model')}, TP={tp}: {tp} GPU{'s' * (tp > 1)}/worker"


def print_tables(summary: dict[str, Any]) -> None:
    for workload, entry in summary["workloads"].items():
        print(f"\n=== {workload} ({_setup(summary)}): attainment / goodput (req/s) / TTFT p90 / TPOT p90 (ms)")
        for config, rows in entry["configs"].items():
            for r in sorted(rows, key=lambda r: r["rate"]):
                print(f"{config:>10} @ {r['rate']:>5g}  {100 * r['attainment']:5.1f}%  {r['goodput_rps']:6.2f}  "
                      f"{_f(r['ttft_p90_ms']):>8}  {_f(r['tpot_p90_ms']):>7}  failed {r['failed']}")
        for config, g in entry["goodput"].items():
            print(f"{config:>10} DistServe goodput: {g}")
        if "distserve_goodput_ratio" in entry:
            print(f"ratio disagg/colocated: {entry.get('distserve_goodput_ratio')} "
                  f"(bound only: {entry.get('ratio_is_bound')}); by rate: "
                  + json.dumps([(r["rate"], r["goodput_ratio"]) for r in entry["ratio_by_rate"]]))
        for rank in entry.get("ranking", []):
            print(f"per-GPU goodput {rank['config']:>10}: {rank['per_gpu']:.2f} req/s/GPU, "
                  f"{rank['of_best']:.2f} of the best{' (censored: at least)' if rank['censored'] else ''}")


    print_handoff_phases(summary)
    print_service_metrics(summary)


def print_service_metrics(summary: dict[str, Any]) -> None:
    """Per run and process: the scheduler's, gateway's and engines' histograms (count, p50 / p90 / p99 /
    mean ms) and counters (increase) over the run (lab/experiments/run_metrics.py)."""
    for entry in summary.get("configurations", {}).values():
        for run in entry.get("runs", []):
            for process, series in sorted((run.get("service_metrics") or {}).items()):
                cells = [f"{k} n={v['count']} p50={_f(v['p50_ms'])} p90={_f(v['p90_ms'])} p99={_f(v['p99_ms'])} "
                         f"mean={_f(v['mean_ms'])}" if isinstance(v, dict) else f"{k} +{v:g}"
                         for k, v in series.items()]
                print(f"service {run['run']} {process}: " + "; ".join(cells))


def print_handoff_phases(summary: dict[str, Any]) -> None:
    """Per disaggregated run: each hand-off phase's count, p50 / p90 / mean (ms), worker by worker."""
    configs = summary.get("configurations", {})
    runs = [run for config, entry in configs.items() if _is_disaggregated(config) for run in entry.get("runs", [])]
    for run in runs:
        for worker, phases in sorted((run.get("handoff_phases") or {}).items()):
            cells = [f"{p} n={v['count']} p50={_f(v['p50_ms'])} p90={_f(v['p90_ms'])} mean={_f(v['mean_ms'])}"
                     for p, v in sorted(phases.items())]
            print(f"hand-off {run['run']} {worker}: " + "; ".join(cells))


def _is_disaggregated(config: str) -> bool:
    try:
        return parse_layout(config).disaggregated
    except ValueError:
        return False


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
