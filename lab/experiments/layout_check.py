"""Did `baton plan` pick the layout that measured best? The 4-GPU experiment's verdict, offline.

    python -m lab.experiments.layout_check OUT_A OUT_B --out results/layouts [--slo 500 20]

OUT_A, OUT_B: outputs of `lab/suites/layouts_suite.sh` (each holds results.tar.gz and, in one of them,
profile-8b.json). Their runs are merged and judged by one SLO (the runs' own, or `--slo`); per workload:
every layout's attainment curve and DistServe goodput per GPU (lab/experiments/distserve_report.py),
then the planner (scheduler/planner.py, the code behind `baton plan`) is given the same profile, the
workload as it was sent (the lowest-rate run's arrivals and lengths: `--trace`), the same SLO, GPU
count, KV pool and batch limit (the simulated gateway's costs: --gateway-request-ms, --gateway-token-us),
and its recommendation is looked up in the measured ranking. The
issue's bar: the recommended layout measured best or within 5% of the best (`of_best >= 0.95`).
Writes OUT/summary.json, OUT/check.json and the attainment/goodput plots; prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lab.experiments import distserve_report as report
from lab.experiments.layouts import parse_layout
from loadtest.metrics import GoodputCriterion
from loadtest.report import load_result
from scheduler.adapters.profiles import ANY_MODEL, ProfileBook
from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import trace_from_rows
from scheduler.planner import Layout, PlanConfig, mean_attainment, plan, scaled_trace
from scheduler.sim.gateway import MEASURED_GATEWAY, GatewayCost
from scheduler.sim.serving import MEASURED_H100, ServingCost
from scheduler.sim.trace import Arrival
from scheduler.types import SLO

WITHIN = 0.95  # the recommendation's measured per-GPU goodput, as a share of the best
HANDOFF_S = 0.011  # the measured 2xH100 hand-off overhead the suite also gives the scheduler


def measured_name(layout: Layout) -> str:
    """The planner's layout in the experiment's naming (TP=1 layouts: c4, 1p3d, ...)."""
    return f"c{layout.decode_workers}" if layout.colocated else f"{layout.prefill_workers}p{layout.decode_workers}d"


def merge_runs(outs: list[Path], into: Path) -> dict[str, Any]:
    """Every OUT's run files into `into`/runs; the summaries' metadata merged (configurations, layout GPUs)."""
    meta: dict[str, Any] = {"configurations": {}, "layout_gpus": {}}
    for out in outs:
        with tarfile.open(out / "results.tar.gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith("runs/")]
            tar.extractall(into, members=members, filter="data")
        summary = out / "summary.json"  # absent when the box sent back too many files: names say enough
        old = json.loads(summary.read_text()) if summary.exists() else {}
        for key, value in old.items():
            if key in ("configurations", "layout_gpus"):
                meta[key].update(value or {})
            elif key != "workloads":
                meta.setdefault(key, value)
    return meta


def workload_trace(runs: Path, workload: str) -> list[dict[str, float]]:
    """The lowest-rate run of `workload` (any layout: all were sent the same) as `baton plan --trace` rows."""
    files = sorted(runs.glob(f"*__{workload}__r*.json"), key=lambda p: float(p.stem.split("__r")[-1]))
    if not files:
        raise ValueError(f"no run of {workload} in {runs}")
    records = [r for run in load_result(files[0]).runs for r in run.records]
    return [{"time_s": r.send_time, "prompt_tokens": r.prompt_tokens or r.prompt_len,
             "output_tokens": r.max_tokens} for r in records]


def load_profile(path: Path) -> WorkerProfile:
    book = ProfileBook.load(path)
    return book.by_model.get(ANY_MODEL) or next(iter(book.by_model.values()))


def run_seed(meta: dict[str, Any]) -> WorkerProfile:
    """The profile the runs' scheduler was started from (summary.json `scheduler_profile`)."""
    seeded = meta.get("scheduler_profile")
    if not seeded:
        raise ValueError("--run-seed: the outputs' summary.json holds no scheduler_profile")
    book = ProfileBook.from_data(seeded)
    return book.by_model.get(ANY_MODEL) or next(iter(book.by_model.values()))


def on_the_runs_grid(trace: list[Arrival], trace_rate: float, layout: Layout, profile: WorkerProfile,
                     config: PlanConfig, rates: list[float]) -> float | None:
    """The planner's per-GPU goodput judged as the runs are: its simulated attainment at the measured rates
    only (`trace`, sent at `trace_rate`, scaled to each), the 90% crossing interpolated between them. The
    planner's own search finds the simulated cliff; a sweep of 12/24/36 draws a straight line across it,
    so the two differ even where the simulator is right."""
    rows = [{"rate": rate, "attainment": mean_attainment(scaled_trace(trace, rate / trace_rate), layout, {1: profile},
                                                         config)} for rate in rates]
    crossing = report.distserve_goodput(rows)["interpolated_90pct_rate"]
    return None if crossing is None else crossing / layout.gpus


def check(summary: dict[str, Any], runs: Path, profile: WorkerProfile, slo: SLO,
          scheduler_seed: WorkerProfile | None = None, gateway: GatewayCost = MEASURED_GATEWAY,
          serving: ServingCost = MEASURED_H100) -> dict[str, Any]:
    """Per workload: the planner's ranking, its recommendation and where that stands in the measured one."""
    verdicts: dict[str, Any] = {}
    for workload, entry in summary["workloads"].items():
        gpus = max(g["gpus"] for g in entry["goodput"].values())
        measured = {r["config"]: r for r in entry["ranking"]}
        config = PlanConfig(gpus=gpus, slo=slo, kv_blocks_per_gpu=int(summary.get("num_blocks") or 20480),
                            max_batch=128, handoff_s=HANDOFF_S, scheduler_seed=scheduler_seed, gateway=gateway,
                            serving=serving)
        trace = trace_from_rows(workload_trace(runs, workload))
        predicted = plan(trace, {1: profile}, config)
        rates = {name: sorted(row["rate"] for row in rows) for name, rows in entry["configs"].items()}
        trace_rate = min(min(r) for r in rates.values())  # workload_trace's run
        choice = measured_name(predicted.best.layout)
        at = measured.get(choice)
        verdicts[workload] = {
            "recommended": choice, "measured_best": entry["ranking"][0]["config"] if entry["ranking"] else None,
            "recommended_of_best": at["of_best"] if at else None,
            "passes": bool(at and at["of_best"] is not None and at["of_best"] >= WITHIN),
            "predicted": [{"layout": measured_name(r.layout), "capacity_rps": r.capacity_rps,
                           "per_gpu": (r.capacity_rps or 0.0) / gpus,
                           "per_gpu_on_runs_grid": on_the_runs_grid(trace, trace_rate, r.layout, profile, config,
                                                                    rates[measured_name(r.layout)])
                           if measured_name(r.layout) in rates else None} for r in predicted.results],
            "measured": entry["ranking"]}
    return verdicts


def print_check(verdicts: dict[str, Any], slo: SLO) -> None:
    for workload, v in verdicts.items():
        print(f"\n=== {workload}, TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms: per-GPU goodput (req/s/GPU)")
        predicted = {p["layout"]: p for p in v["predicted"]}
        for m in v["measured"]:
            p = predicted.get(m["config"], {})
            print(f"{m['config']:>6}  measured {m['per_gpu']:6.2f}{'+' if m['censored'] else ' '} "
                  f"({m['of_best']:.2f} of best)   predicted {_num(p.get('per_gpu'))}, "
                  f"on the runs' rates {_num(p.get('per_gpu_on_runs_grid'))}")
        print(f"baton plan recommends {v['recommended']}; measured best {v['measured_best']}; "
              f"recommended at {v['recommended_of_best']} of the best -> {'PASS' if v['passes'] else 'FAIL'}")


def _num(value: float | None) -> str:
    return "  -   " if value is None else f"{value:6.2f}"


def parse_args(prog: str, doc: str | None, argv: list[str] | None) -> tuple[argparse.Namespace, Path]:
    """The outputs, --out (created), --profile (default: the first OUT's profile-8b.json) and --slo."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outs", type=Path, nargs="+", help="layouts_suite.sh outputs")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", type=Path, default=None, help="default: the first OUT's profile-8b.json")
    p.add_argument("--slo", type=float, nargs=2, default=None, metavar=("TTFT_MS", "TPOT_MS"))
    p.add_argument("--run-seed", action="store_true",
                   help="start the simulated scheduler from the profile the runs' scheduler had (summary.json "
                        "scheduler_profile), not --profile: the runs' own siting decisions")
    p.add_argument("--gateway-request-ms", type=float, default=MEASURED_GATEWAY.per_request_s * 1e3,
                   help="the simulated gateway's loop CPU per request (as baton plan)")
    p.add_argument("--gateway-token-us", type=float, default=MEASURED_GATEWAY.per_token_s * 1e6,
                   help="the simulated gateway's loop CPU per streamed token (as baton plan)")
    p.add_argument("--gateway-admission-rounds", type=float, default=MEASURED_GATEWAY.admission_rounds,
                   help="the loop rounds a request waits on its way in (as baton plan)")
    p.add_argument("--gateway-processes", type=int, default=None,
                   help="gateway processes (as baton plan; default: the runs' own, summary.json)")
    p.add_argument("--serving-step-ms", type=float, default=MEASURED_H100.per_step_s * 1e3,
                   help="a served step's cost beyond the profile, per step (as baton plan)")
    p.add_argument("--serving-seq-us", type=float, default=MEASURED_H100.per_seq_s * 1e6,
                   help="... per sequence in the step (as baton plan)")
    p.add_argument("--serving-context-ns", type=float, default=MEASURED_H100.per_context_token_s * 1e9,
                   help="... per context token of the decoding sequences (as baton plan)")
    p.add_argument("--serving-sampled-share", type=float, default=MEASURED_H100.sampled_share,
                   help="the share of that cost the workers' step samples carry (as baton plan)")
    args = p.parse_args(argv)
    profile_path = args.profile or next((o / "profile-8b.json" for o in args.outs
                                         if (o / "profile-8b.json").exists()), None)
    if profile_path is None:
        p.error("no profile-8b.json in the outputs: give --profile")
    args.out.mkdir(parents=True, exist_ok=True)
    return args, profile_path


def gateway_cost(args: argparse.Namespace, meta: dict[str, Any] | None = None) -> GatewayCost:
    """The simulated gateway of the --gateway-* flags; its process count, unless given, the runs' (`meta`:
    their summary.json; runs from before the count was recorded had one process)."""
    processes = args.gateway_processes or int((meta or {}).get("gateway_processes") or 1)
    return GatewayCost(per_request_s=args.gateway_request_ms / 1e3, per_token_s=args.gateway_token_us / 1e6,
                       admission_rounds=args.gateway_admission_rounds, processes=processes)


def serving_cost(args: argparse.Namespace) -> ServingCost:
    """The simulated workers' serving cost of the --serving-* flags; the hand-off terms stay the measured ones."""
    return replace(MEASURED_H100, per_step_s=args.serving_step_ms / 1e3, per_seq_s=args.serving_seq_us / 1e6,
                   per_context_token_s=args.serving_context_ns / 1e9, sampled_share=args.serving_sampled_share)


def run_slo(args: argparse.Namespace, meta: dict[str, Any]) -> SLO:
    """--slo, else the runs' own."""
    return slo_or_stored(args.slo, meta)


def slo_or_stored(slo: Sequence[float] | None, meta: dict[str, Any]) -> SLO:
    """(TTFT ms, TPOT ms) when given, else the SLO the runs were judged at (their summary.json)."""
    stored = meta.get("slo") or {}
    return SLO(*slo) if slo else SLO(stored["ttft_ms"], stored["tpot_ms"])


def main(argv: list[str] | None = None) -> int:
    args, profile_path = parse_args("lab.experiments.layout_check", __doc__, argv)
    with tempfile.TemporaryDirectory(prefix="layout-check-") as tmp:
        meta = merge_runs(args.outs, Path(tmp))
        for run in (Path(tmp) / "runs").glob("*.json"):
            parse_layout(run.stem.split("__")[0])  # an unknown name fails here, not mid-report
        slo = run_slo(args, meta)
        summary = report.summarize(Path(tmp) / "runs", meta, GoodputCriterion(slo.ttft_ms, slo.tpot_ms))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        report.print_tables(summary)
        seed = run_seed(meta) if args.run_seed else None
        verdicts = check(summary, Path(tmp) / "runs", load_profile(profile_path), slo, seed,
                         gateway_cost(args, meta), serving_cost(args))
        (args.out / "check.json").write_text(json.dumps(verdicts, indent=1) + "\n")
        print_check(verdicts, slo)
        report.plot(Path(tmp) / "runs", args.out, summary)
    return 0 if all(v["passes"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
