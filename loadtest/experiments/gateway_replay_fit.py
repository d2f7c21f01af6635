"""Which simulated-gateway costs replay measured layout runs best: a grid search over `baton plan`'s gateway.

    python -m loadtest.experiments.gateway_replay_fit OUT [OUT ...] --profile P.json \
        [--token-us 120 140 160] [--rounds 3 4 5] [--request-ms 2.66] [--slo 500 50]

OUT: outputs of `loadtest/micro/layouts_suite.sh`, one machine each (several machines: several OUTs). Every
run is replayed through the planner's simulator (`layout_replay`) once per grid point, and each point is
scored by the mean |log(simulated / measured)| of TTFT p50 and p90 and TPOT p50 and p90 (so 0.1 is ~10%
off), and by the mean attainment error, over the runs that served at least half their requests within
the SLO (past that the percentiles are of the few served). Lowest total first. The defaults in
scheduler/sim/gateway.py (MEASURED_GATEWAY) came from this search (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.experiments import layout_check
from loadtest.experiments.layout_replay import Row, compare_runs, replay_config
from scheduler.sim.gateway import MEASURED_GATEWAY, GatewayCost

PERCENTILES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")
MIN_ATTAINMENT = 0.5  # runs below it are left out of the score


@dataclass(frozen=True)
class Score:
    cost: GatewayCost
    log_errors: dict[str, float]  # mean |log(simulated / measured)| per percentile
    attainment_error: float  # mean |simulated - measured| attainment
    runs: int

    @property
    def total(self) -> float:
        return sum(self.log_errors.values())


def score(cost: GatewayCost, rows: Sequence[Row]) -> Score:
    kept = [r for r in rows if r.measured.attainment >= MIN_ATTAINMENT]
    errors: dict[str, list[float]] = {name: [] for name in PERCENTILES}
    for row in kept:
        for name in PERCENTILES:
            measured, simulated = getattr(row.measured, name), getattr(row.simulated, name)
            if measured and simulated:
                errors[name].append(abs(math.log(simulated / measured)))
    attainment = [abs(r.simulated.attainment - r.measured.attainment) for r in kept]
    return Score(cost, {name: _mean(values) for name, values in errors.items()}, _mean(attainment), len(kept))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def replay_all(outs: Sequence[Path], profile_path: Path, cost: GatewayCost, slo: Sequence[float] | None) -> list[Row]:
    """Every run of every OUT replayed with `cost` (each OUT with its own block count, and its own SLO
    unless `slo` (TTFT ms, TPOT ms) is given)."""
    rows: list[Row] = []
    profile = layout_check.load_profile(profile_path)
    for out in outs:
        with tempfile.TemporaryDirectory(prefix="gateway-fit-") as tmp:
            meta = layout_check.merge_runs([out], Path(tmp))
            config = replay_config(meta, layout_check.slo_or_stored(slo, meta), cost)
            rows += compare_runs(Path(tmp) / "runs", profile, config, meta)
    return rows


def search(outs: Sequence[Path], profile: Path, grid: Sequence[GatewayCost],
           slo: Sequence[float] | None) -> list[Score]:
    return sorted((score(cost, replay_all(outs, profile, cost, slo)) for cost in grid), key=lambda s: s.total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.experiments.gateway_replay_fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outs", nargs="+", type=Path)
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--token-us", type=float, nargs="+", default=[MEASURED_GATEWAY.per_token_s * 1e6])
    p.add_argument("--rounds", type=float, nargs="+", default=[MEASURED_GATEWAY.admission_rounds])
    p.add_argument("--request-ms", type=float, nargs="+", default=[MEASURED_GATEWAY.per_request_s * 1e3])
    p.add_argument("--slo", type=float, nargs=2, default=None, metavar=("TTFT_MS", "TPOT_MS"),
                   help="default: each OUT's own")
    args = p.parse_args(argv)
    grid = [GatewayCost(per_request_s=r / 1e3, per_token_s=t / 1e6, admission_rounds=n)
            for r, t, n in itertools.product(args.request_ms, args.token_us, args.rounds)]
    print(f"{'request ms':>10} {'token us':>8} {'rounds':>6}  " + " ".join(f"{n:>11}" for n in PERCENTILES)
          + f" {'total':>6} {'attain.':>7} runs")
    for s in search(args.outs, args.profile, grid, args.slo):
        print(f"{s.cost.per_request_s * 1e3:10.3g} {s.cost.per_token_s * 1e6:8.3g} {s.cost.admission_rounds:6.3g}  "
              + " ".join(f"{s.log_errors[n]:11.3f}" for n in PERCENTILES)
              + f" {s.total:6.3f} {s.attainment_error:7.3f} {s.runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
