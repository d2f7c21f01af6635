"""Each measured layout run against `baton plan`'s simulator, request stream for request stream.

    python -m lab.experiments.layout_replay OUT_A [OUT_B ...] --out DIR [--profile F] [--slo T P]

OUT_*: outputs of `lab/suites/layouts_suite.sh` (as for layout_check.py). Every run (layout x workload x
rate) is replayed through the simulator `baton plan` uses (scheduler/planner.py: the same workers, profile,
KV pool, batch limit, hand-off price and serving cost) on its own arrivals and lengths, and the two are put
side by side: attainment, TTFT and TPOT p50/p90, requests refused (HTTP 503 measured, admission timeouts
simulated) and how many prompts went to a prefill worker (measured: the decode workers' hand-off count,
when the OUT has a summary.json). Where the planner's ranking goes wrong, this says which phase the
simulator gets wrong, and at which load. Writes DIR/replay.json; prints the table.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from lab.experiments import layout_check
from lab.experiments.layouts import parse_layout
from loadtest.metrics import GoodputCriterion, request_tpot
from loadtest.records import RequestRecord
from loadtest.report import load_result
from scheduler.calibration.replay_score import Row, Side
from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import trace_from_rows
from scheduler.planner import Layout, PlanConfig, replay_layout
from scheduler.sim.gateway import GatewayCost
from scheduler.sim.results import ReplayResult
from scheduler.sim.serving import MEASURED_H100, ServingCost
from scheduler.types import SLO

PREFILL_COMPUTE = "prefill_compute"  # services/worker/metrics.py HandoffPhase values, as summary.json keys them
OVERHEAD = "overhead"


def planner_layout(name: str) -> Layout:
    return parse_layout(name).layout


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else None


def measured_side(records: Sequence[RequestRecord], slo: SLO, remote: int | None,
                  phases: dict[str, float] | None = None) -> Side:
    """`phases`: mean ms of the hand-off phases (`measured_phase_mean`) by name."""
    ttft = [r.ttft for r in records if r.ok and r.ttft is not None]
    tpot = [t for r in records if (t := request_tpot(r)) is not None]
    met = sum(GoodputCriterion(slo.ttft_ms, slo.tpot_ms).met(r) for r in records)
    phases = phases or {}
    return Side(met / len(records), _pct(ttft, 50), _pct(ttft, 90), _pct(tpot, 50), _pct(tpot, 90),
                sum(not r.ok for r in records), remote, phases.get(PREFILL_COMPUTE), phases.get(OVERHEAD))


def simulated_side(result: ReplayResult) -> Side:
    ttft = [o.ttft_s for o in result.outcomes if o.ttft_s is not None]
    tpot = [o.tpot_s for o in result.outcomes if o.tpot_s is not None]
    compute = [o.prefill_compute_s for o in result.outcomes if o.prefill_compute_s is not None]
    overhead = [o.handoff_overhead_s for o in result.outcomes if o.handoff_overhead_s is not None]
    return Side(result.goodput, _pct(ttft, 50), _pct(ttft, 90), _pct(tpot, 50), _pct(tpot, 90), result.rejected,
                sum(o.prefill_worker_id is not None for o in result.outcomes), _mean_ms(compute), _mean_ms(overhead))


def _mean_ms(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) * 1e3 if values else None


def measured_remote(meta: dict[str, Any], run: str) -> int | None:
    """Hand-offs the run's decode workers committed (a summary.json's per-run hand-off phases)."""
    for config in (meta.get("configurations") or {}).values():
        for entry in config.get("runs", []):
            if entry.get("run") == run:
                phases = entry.get("handoff_phases") or {}
                return sum(int(p.get("handoff", {}).get("count", 0)) for p in phases.values())
    return None


def replay_run(path: Path, profile: WorkerProfile, config: PlanConfig) -> tuple[list[RequestRecord], ReplayResult]:
    """A measured run's records, and its own request stream replayed on its layout."""
    records = [r for run in load_result(path).runs for r in run.records]
    rows = [{"time_s": r.send_time, "prompt_tokens": r.prompt_tokens or r.prompt_len, "output_tokens": r.max_tokens}
            for r in records]
    layout = planner_layout(path.stem.split("__")[0])
    return records, replay_layout(trace_from_rows(rows, config.block_size), layout, {1: profile}, config)


def measured_phase_mean(meta: dict[str, Any], run: str, phase: str) -> tuple[int, float] | None:
    """(count, mean ms) of one hand-off phase over a run's workers, count-weighted (None: not kept)."""
    for config in (meta.get("configurations") or {}).values():
        for entry in config.get("runs", []):
            if entry.get("run") != run:
                continue
            found = [p[phase] for p in (entry.get("handoff_phases") or {}).values() if p.get(phase, {}).get("count")]
            count = sum(int(p["count"]) for p in found)
            if count:
                return count, sum(p["count"] * p["mean_ms"] for p in found) / count
    return None


def compare_run(path: Path, profile: WorkerProfile, config: PlanConfig, meta: dict[str, Any]) -> Row:
    records, result = replay_run(path, profile, config)
    phases = {name: found[1] for name in (PREFILL_COMPUTE, OVERHEAD)
              if (found := measured_phase_mean(meta, path.stem, name)) is not None}
    measured = measured_side(records, config.slo, measured_remote(meta, path.stem), phases)
    return Row(path.stem, measured, simulated_side(result))


def print_rows(rows: Sequence[Row], slo: SLO) -> None:
    print(f"TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms; each cell measured / simulated")
    print(f"{'run':26} {'attainment':>12} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'TPOT p50 ms':>12} "
          f"{'TPOT p90 ms':>12} {'refused':>9} {'remote':>9} {'compute ms':>11} {'overhead ms':>11}")
    for r in rows:
        m, s = r.measured, r.simulated
        cells = [f"{m.attainment:.2f}/{s.attainment:.2f}"]
        for a, b in ((m.ttft_p50_ms, s.ttft_p50_ms), (m.ttft_p90_ms, s.ttft_p90_ms), (m.tpot_p50_ms, s.tpot_p50_ms),
                     (m.tpot_p90_ms, s.tpot_p90_ms)):
            cells.append(f"{_num(a)}/{_num(b)}")
        cells += [f"{m.refused}/{s.refused}", f"{'-' if m.remote is None else m.remote}/{s.remote}"]
        phases = [f"{_num(a)}/{_num(b)}" for a, b in ((m.prefill_compute_ms, s.prefill_compute_ms),
                                                       (m.overhead_ms, s.overhead_ms))]
        print(f"{r.run:26} " + " ".join(f"{c:>12}" for c in cells[:5]) + " " + " ".join(f"{c:>9}" for c in cells[5:])
              + " " + " ".join(f"{c:>11}" for c in phases))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def replay_config(meta: dict[str, Any], slo: SLO, gateway: GatewayCost,
                  scheduler_seed: WorkerProfile | None = None, serving: ServingCost = MEASURED_H100) -> PlanConfig:
    """The planner's simulator set up as the runs of `meta` were served (KV pool, batch limit, hand-off)."""
    return PlanConfig(gpus=1, slo=slo, kv_blocks_per_gpu=int(meta.get("num_blocks") or 20480), max_batch=128,
                      handoff_s=layout_check.HANDOFF_S, gateway=gateway, scheduler_seed=scheduler_seed,
                      serving=serving)


def compare_runs(runs_dir: Path, profile: WorkerProfile, config: PlanConfig, meta: dict[str, Any]) -> list[Row]:
    """Every run in `runs_dir` (a `layout_check.merge_runs` output) against its replay."""
    return [compare_run(path, profile, config, meta) for path in sorted(runs_dir.glob("*.json"))]


def main(argv: list[str] | None = None) -> int:
    args, profile_path = layout_check.parse_args("lab.experiments.layout_replay", __doc__, argv)
    with tempfile.TemporaryDirectory(prefix="layout-replay-") as tmp:
        meta = layout_check.merge_runs(args.outs, Path(tmp))
        slo = layout_check.run_slo(args, meta)
        config = replay_config(meta, slo, layout_check.gateway_cost(args, meta),
                               layout_check.run_seed(meta) if args.run_seed else None, layout_check.serving_cost(args))
        rows = compare_runs(Path(tmp) / "runs", layout_check.load_profile(profile_path), config, meta)
    (args.out / "replay.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print_rows(rows, slo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
