"""Which simulated-gateway costs replay measured layout runs best: a grid search over `baton plan`'s gateway.

    python -m lab.experiments.gateway_replay_fit OUT [OUT ...] --profile P.json \
        [--token-us 120 140 160] [--rounds 3 4 5] [--request-ms 2.66] [--slo 500 50]

OUT: outputs of `lab/suites/layouts_suite.sh`, one machine each (several machines: several OUTs). Every
run is replayed through the planner's simulator (`layout_replay`) once per grid point, and each point is
scored by the mean |log(simulated / measured)| of TTFT p50 and p90 and TPOT p50 and p90 (so 0.1 is ~10%
off), and by the mean attainment error, over the runs that served at least half their requests within
the SLO (past that the percentiles are of the few served; scheduler/calibration/replay_score.py). Lowest
total first. The defaults in
scheduler/sim/gateway.py (MEASURED_GATEWAY) came from this search (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lab.experiments import layout_check
from lab.experiments.layout_replay import compare_runs, replay_config
from scheduler.calibration.replay_score import PERCENTILES, Row, Score, score
from scheduler.sim.gateway import MEASURED_GATEWAY, GatewayCost


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
    p = argparse.ArgumentParser(prog="python -m lab.experiments.gateway_replay_fit", description=__doc__,
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
