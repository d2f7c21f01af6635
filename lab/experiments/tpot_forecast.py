"""How well the scheduler forecast the TTFT and TPOT of the requests it placed, and the prefill stretch.

    .venv/bin/python -m lab.experiments.tpot_forecast results/pcs_r1/exp1_random__goodput [...]
    .venv/bin/python -m lab.experiments.tpot_forecast DISTSERVE_OUT  # a GPU run with --tap-scheduler

Each argument is one `policy_compare` run directory (its `bench*.json` and `scheduler_tap.json`), or a
`distserve` output folder run with `--tap-scheduler` (its `runs/*.json` and `logs/<layout>-scheduler_tap.json`:
one tap per layout, covering all its runs; each run takes the routes made while it ran, by wall clock).
Per decode worker it prints, as medians over the requests placed there:
- measured / predicted TTFT: from the scheduler's placement to the client's first token (the tap's
  clock plus the client's times, `mixed_steps.pair_requests`) against `predicted_ttft_ms`; for a
  queued request, from the decision that placed it;
- measured / predicted TPOT: the client's TPOT (first token to last, per later token) against the
  decision's `predicted_tpot_ms`;
- measured / predicted base: the TPOT less the stretch, measured (the client's TPOT less the mixed
  steps' excess below) against predicted (`predicted_tpot_ms - predicted_stretch_ms`): the decode step
  at the forecast batch, so a TPOT miss reads as a wrong batch or step cost, or a wrong stretch;
- measured / predicted stretch: of that prediction, the part the worker's prefill share adds
  (`predicted_stretch_ms`, scheduler/core/prefill_load.py) against what the prompts folded into the
  request's steps measurably added: over the request's life, each mixed step the worker reported less
  the median pure decode step of its batch size, summed and spread over the request's later tokens.
  Only requests with a stretch of at least 1 ms count here.

The mixed steps of a request's life are those reported by heartbeats from its first token to one
heartbeat interval after its last (a heartbeat carries the steps since the previous one), so a step
at either end may be counted or missed: a diagnostic, a few percent per request, not a measurement
of one step. Pass Q in docs/benchmarks.md used it to find that the stretch forecast 1.5-2x what the
mixed steps added.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lab.experiments.analysis import placed_routes
from lab.experiments.mixed_steps import ServedRequest, pair_requests
from loadtest.report import load_result

_MIN_STRETCH_MS = 1.0
# policy_compare's bench files and the tier each one's key sends
_TIERS = {"bench": "enterprise", "bench_enterprise": "enterprise", "bench_free": "free"}


@dataclass(frozen=True)
class Forecast:
    """One placed request: what the scheduler predicted and what its life measured."""

    worker_id: str
    ttft_ms: float  # from the placing decision to the first token
    predicted_ttft_ms: float
    tpot_ms: float  # the client's
    predicted_tpot_ms: float
    predicted_stretch_ms: float
    mixed_excess_ms: float  # per later token: what the mixed steps of its life added over pure decode steps


@dataclass(frozen=True)
class WorkerAccuracy:
    worker_id: str
    requests: int
    ttft_ratio: float  # median measured / predicted TTFT
    tpot_ratio: float  # median measured / predicted TPOT
    base_ratio: float  # median measured / predicted TPOT less the stretch (see the module doc)
    stretch_ratio: float | None  # median measured / predicted stretch (None: no request had a stretch)


def forecasts(tap: Mapping[str, Any], served: Sequence[ServedRequest], heartbeat_s: float) -> list[Forecast]:
    """`served` paired from the tap's placed routes (`pair_requests`): each with its decision's predictions."""
    decisions = {r["t"]: r["decision"] for tier in set(_TIERS.values()) for r in placed_routes(tap, tier)}
    placed_at = _placement_times(tap)
    pure = _pure_decode_medians(tap["samples"])
    out = []
    for request in served:
        decision = decisions.get(request.routed_at)
        times = request.token_times
        if decision is None or decision.get("predicted_tpot_ms") is None or len(times) < 2:
            continue
        later = len(times) - 1
        steps = tap["samples"].get(request.worker_id, [])
        excess = sum(row[6] - pure[request.worker_id].get(row[4], row[6]) for row in steps
                     if row[0] == "mixed" and times[0] < row[1] <= times[-1] + heartbeat_s)
        placed = placed_at.get(decision["request_id"], request.routed_at)
        out.append(Forecast(request.worker_id, 1e3 * (times[0] - placed), decision["predicted_ttft_ms"],
                            1e3 * (times[-1] - times[0]) / later, decision["predicted_tpot_ms"],
                            decision.get("predicted_stretch_ms") or 0.0, 1e3 * excess / later))
    return out


def accuracy(found: Sequence[Forecast]) -> list[WorkerAccuracy]:
    out = []
    for worker_id in sorted({f.worker_id for f in found}):
        mine = [f for f in found if f.worker_id == worker_id]
        stretched = [f.mixed_excess_ms / f.predicted_stretch_ms for f in mine
                     if f.predicted_stretch_ms >= _MIN_STRETCH_MS]
        out.append(WorkerAccuracy(worker_id, len(mine),
                                  statistics.median(f.ttft_ms / f.predicted_ttft_ms for f in mine),
                                  statistics.median(f.tpot_ms / f.predicted_tpot_ms for f in mine),
                                  statistics.median(_base_ratio(f) for f in mine),
                                  statistics.median(stretched) if stretched else None))
    return out


def _base_ratio(f: Forecast) -> float:
    predicted = max(f.predicted_tpot_ms - f.predicted_stretch_ms, 1e-9)
    return (f.tpot_ms - f.mixed_excess_ms) / predicted


def _placement_times(tap: Mapping[str, Any]) -> dict[str, float]:
    """When each request was placed: its route, or the later decision that placed a queued one."""
    placed = {r["decision"]["request_id"]: r["t"] for r in tap["routes"]}
    placed.update((d["decision"]["request_id"], d["t"]) for d in tap["late_decisions"])
    return placed


def _pure_decode_medians(samples: Mapping[str, Sequence[Sequence[Any]]]) -> dict[str, dict[int, float]]:
    """Per worker and batch size, the median pure decode step (seconds)."""
    out: dict[str, dict[int, float]] = {}
    for worker_id, rows in samples.items():
        by_batch: dict[int, list[float]] = {}
        for row in rows:
            if row[0] == "decode":
                by_batch.setdefault(row[2], []).append(row[4])
        out[worker_id] = {batch: statistics.median(steps) for batch, steps in by_batch.items()}
    return out


def run_forecasts(run_dir: Path, heartbeat_s: float) -> list[Forecast]:
    tap = json.loads((run_dir / "scheduler_tap.json").read_text())
    served: list[ServedRequest] = []
    for bench in sorted(run_dir.glob("bench*.json")):
        records = load_result(bench).runs[0].records
        routes = placed_routes(tap, _TIERS.get(bench.stem, "enterprise"))
        served += pair_requests(routes, records, templated="multiturn" in run_dir.name)
    return forecasts(tap, served, heartbeat_s)


def suite_forecasts(out_dir: Path, heartbeat_s: float) -> dict[str, list[Forecast]]:
    """A `distserve --tap-scheduler` output folder: per run (`runs/<layout>__<workload>__r<rate>.json`),
    the forecasts of the requests its bench sent."""
    taps: dict[str, dict[str, Any]] = {}
    out: dict[str, list[Forecast]] = {}
    for bench in sorted((out_dir / "runs").glob("*.json")):
        layout = bench.stem.split("__")[0]
        tap_path = out_dir / "logs" / f"{layout}-scheduler_tap.json"
        if not tap_path.exists():
            continue
        tap = taps.setdefault(layout, json.loads(tap_path.read_text()))
        run = load_result(bench).runs[0]
        created_at = json.loads(bench.read_text())["created_at"]  # when the bench wrote it: the run's end
        routes = [r for r in placed_routes(tap, "enterprise")
                  if _within_run(r["t"] + tap["time_offset_s"], created_at, run.duration)]
        out[bench.stem] = forecasts(tap, pair_requests(routes, run.records), heartbeat_s)
    return out


def _within_run(wall_s: float, created_at: str, duration_s: float) -> bool:
    """Whether a route made at `wall_s` (epoch seconds) belongs to the run whose report was written at
    `created_at` (ISO, truncated to the second) after `duration_s` of sending and draining; the suites
    leave seconds between runs, so a second's margin either side separates them."""
    end = datetime.fromisoformat(created_at).timestamp() + 1.0
    return end - duration_s - 2.0 <= wall_s <= end


def _print_row(name: str, a: WorkerAccuracy) -> None:
    stretch = "-" if a.stretch_ratio is None else f"{a.stretch_ratio:.2f}"
    print(f"| {name} | {a.worker_id} | {a.requests} | {a.ttft_ratio:.2f} | {a.tpot_ratio:.2f} | "
          f"{a.base_ratio:.2f} | {stretch} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.tpot_forecast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path,
                        help="policy_compare run directories, or distserve output folders (with runs/)")
    parser.add_argument("--heartbeat-s", type=float, default=0.3,
                        help="the workers' heartbeat interval (policy_compare 0.3; distserve's are 0.2)")
    args = parser.parse_args(argv)
    print("| run | worker | requests | measured/predicted: TTFT | TPOT | base | stretch |")
    print("|---|---|---|---|---|---|---|")
    for path in args.runs:
        if (path / "runs").is_dir():
            for name, found in suite_forecasts(path, args.heartbeat_s).items():
                for a in accuracy(found):
                    _print_row(name, a)
            continue
        for a in accuracy(run_forecasts(path, args.heartbeat_s)):
            _print_row(f"{path.parent.name}/{path.name}", a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
