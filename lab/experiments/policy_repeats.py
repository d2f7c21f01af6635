"""Repeats of `policy_compare`: mean and spread per run, and the policy-quality verdicts over all of them.

    .venv/bin/python -m lab.experiments.policy_repeats results/pcq1 results/pcq2 results/pcq3

Each argument is one `policy_compare --out` directory (its `summary.json`). Per experiment and run it
prints the real goodput fraction, the enterprise TTFT p90, the simulator's error (simulated minus real
goodput, percentage points) and its TTFT p90 ratio, each as mean [min-max] over the repeats. Then the
verdicts the scheduler issue asks for:
- in every repeat and experiment, `goodput` is at least `least_loaded` and `round_robin` (a tie counts);
  a loss names how fast the host ran the engines in the goodput run against the baseline's run (the
  ratio of their `engine_step_ms`): the policies run one after another, and the host's speed drifts;
- in every overload repeat (`exp3_overload`), enterprise TTFT p90 is within its SLO under `goodput`;
- over every run of every repeat, the simulator's mean |error| is at most 5 pp, and its TTFT p90 is
  within 20% of the real one in every run.
The same two figures for the replays run at the speed each run's host ran its workers at, window by
window (`analysis.py`, `simulate.host_speeds`), follow as context, not as verdicts: how much of the
error is the shared host drifting between runs and within them rather than the simulator's model of
the policies and workers. So does the TTFT p90 read per configuration over the repeats: the simulated
mean against the real mean, and in how many configurations the real p90 alone moves by more than the
tolerance between repeats (where it does, no prediction of a run can be within it every time).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab.experiments.policy_compare import SLO_ENTERPRISE

GOODPUT, BASELINES = "goodput", ("least_loaded", "round_robin")
OVERLOAD = "exp3_overload"
MAX_MEAN_ABS_ERROR_PP = 5.0
MAX_TTFT_RATIO_ERROR = 0.20


@dataclass(frozen=True)
class RunResult:
    """One run (experiment x policy) of one repeat."""

    experiment: str
    run: str
    good: float  # real goodput fraction
    enterprise_ttft_p90_ms: float | None  # None: the run had no enterprise requests
    sim_error_pp: float
    sim_ttft_ratio: float  # simulated / real TTFT p90
    engine_step_ms: float | None = None  # the host's speed during the run (`analysis.engine_step_ms`)
    sim_host_replayed_error_pp: float | None = None  # the replay at the run's host speed (analysis.py)
    sim_host_replayed_ttft_ratio: float | None = None  # its simulated / real TTFT p90
    ttft_p90_ms: float | None = None  # real, every tier's completed requests
    sim_ttft_p90_ms: float | None = None


def load(summary: dict) -> list[RunResult]:
    results = []
    for experiment, data in summary.items():
        for run, result in data["runs"].items():
            real, sim = result["real"], result["sim"]
            enterprise = real.get("by_tier", {}).get("enterprise")
            replayed = result.get("sim_host_replayed")
            results.append(RunResult(
                experiment, run, real["goodput_fraction"],
                enterprise["ttft_p90_ms"] if enterprise else None,
                100.0 * (sim["goodput_fraction"] - real["goodput_fraction"]),
                _ttft_ratio(sim, real), real.get("engine_step_ms"), result.get("sim_host_replayed_error_pp"),
                None if replayed is None else _ttft_ratio(replayed, real), real["ttft_p90_ms"], sim["ttft_p90_ms"]))
    return results


def _ttft_ratio(sim: dict, real: dict) -> float:
    return sim["ttft_p90_ms"] / real["ttft_p90_ms"] if real["ttft_p90_ms"] else float("inf")


def _spread(values: Sequence[float], fmt: str) -> str:
    return f"{format(statistics.fmean(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def table(repeats: Sequence[list[RunResult]]) -> list[str]:
    keys = dict.fromkeys((r.experiment, r.run) for rs in repeats for r in rs)
    lines = ["| experiment | run | repeats | real good % | enterprise TTFT p90 ms | sim error pp | sim/real TTFT p90 "
             "| engine step ms |",
             "|---|---|---|---|---|---|---|---|"]
    for experiment, run in keys:
        rows = [r for rs in repeats for r in rs if (r.experiment, r.run) == (experiment, run)]
        ttfts = [r.enterprise_ttft_p90_ms for r in rows if r.enterprise_ttft_p90_ms is not None]
        engines = [r.engine_step_ms for r in rows if r.engine_step_ms is not None]
        lines.append(f"| {experiment} | {run} | {len(rows)} | {_spread([100 * r.good for r in rows], '.1f')} | "
                     f"{_spread(ttfts, '.0f') if ttfts else '-'} | {_spread([r.sim_error_pp for r in rows], '+.1f')} | "
                     f"{_spread([r.sim_ttft_ratio for r in rows], '.2f')} | "
                     f"{_spread(engines, '.0f') if engines else '-'} |")
    return lines


@dataclass(frozen=True)
class Verdict:
    name: str
    passed: bool
    detail: str


def _engine_ratio(ours: RunResult, baseline: RunResult) -> str:
    """The host's speed in the goodput run against the baseline's: the policies run one after another on
    a shared machine, and a loss on an engine ~30% slower says more about the host than the policy."""
    if ours.engine_step_ms is None or baseline.engine_step_ms is None:
        return ""
    return f" (engine step {ours.engine_step_ms / baseline.engine_step_ms:.2f}x the {baseline.run} run's)"


def verdicts(repeats: Sequence[list[RunResult]]) -> list[Verdict]:
    losses = []
    for i, results in enumerate(repeats, 1):
        by_key = {(r.experiment, r.run): r for r in results}
        for (experiment, run), r in by_key.items():
            ours = by_key.get((experiment, GOODPUT))
            if run in BASELINES and ours is not None and ours.good < r.good:
                losses.append(f"repeat {i} {experiment}: goodput {100 * ours.good:.1f}% < {run} {100 * r.good:.1f}%"
                              + _engine_ratio(ours, r))
    overload = [r for rs in repeats for r in rs if (r.experiment, r.run) == (OVERLOAD, GOODPUT)]
    ttft_slo = SLO_ENTERPRISE[0]
    within = [r for r in overload if r.enterprise_ttft_p90_ms is not None and r.enterprise_ttft_p90_ms <= ttft_slo]
    every = [r for rs in repeats for r in rs]
    mean_abs = statistics.fmean(abs(r.sim_error_pp) for r in every) if every else float("inf")
    off = [r for r in every if abs(r.sim_ttft_ratio - 1) > MAX_TTFT_RATIO_ERROR]
    return [
        Verdict("goodput >= least_loaded and round_robin, every repeat and load", not losses,
                "; ".join(losses) or "no loss"),
        Verdict(f"enterprise TTFT p90 <= {ttft_slo:.0f} ms in every overload repeat",
                bool(overload) and len(within) == len(overload),
                f"{len(within)}/{len(overload)}: " + ", ".join(f"{r.enterprise_ttft_p90_ms:.0f}" for r in overload)),
        Verdict(f"simulator mean |error| <= {MAX_MEAN_ABS_ERROR_PP:.0f} pp", mean_abs <= MAX_MEAN_ABS_ERROR_PP,
                f"{mean_abs:.1f} pp over {len(every)} runs"),
        Verdict(f"simulated TTFT p90 within {100 * MAX_TTFT_RATIO_ERROR:.0f}% in every run", not off,
                f"{len(every) - len(off)}/{len(every)} within; off: " +
                ", ".join(f"{r.experiment}/{r.run} x{r.sim_ttft_ratio:.2f}" for r in off)),
    ]


def host_speed_context(repeats: Sequence[list[RunResult]]) -> str | None:
    """The simulator's mean |error| and TTFT p90 count when each run is replayed at its host's speed:
    context for the verdicts, not the verdicts (None when the summaries predate it)."""
    replayed = [r for rs in repeats for r in rs if r.sim_host_replayed_error_pp is not None]
    if not replayed:
        return None
    mean = statistics.fmean(abs(r.sim_host_replayed_error_pp or 0.0) for r in replayed)
    ratios = [r.sim_host_replayed_ttft_ratio for r in replayed if r.sim_host_replayed_ttft_ratio is not None]
    within = sum(abs(x - 1.0) <= MAX_TTFT_RATIO_ERROR for x in ratios)
    return (f"replayed at each run's host speed, the simulator's mean |error| is {mean:.1f} pp over "
            f"{len(replayed)} runs, its TTFT p90 within {100 * MAX_TTFT_RATIO_ERROR:.0f}% in {within}/{len(ratios)}")


def per_configuration_context(repeats: Sequence[list[RunResult]]) -> str | None:
    """The TTFT p90 verdict read per configuration (experiment x policy) over the repeats: the simulated
    p90s' mean against the real ones' mean, and how far the real p90 itself moves between repeats of one
    configuration. Where that spread is wider than the tolerance, no prediction of a run, however exact
    about the configuration, is within it in every repeat: context for the per-run verdict, not a verdict.
    None with fewer than two repeats."""
    if len(repeats) < 2:
        return None
    keys = dict.fromkeys((r.experiment, r.run) for rs in repeats for r in rs)
    within, wide = 0, []
    for key in keys:
        rows = [r for rs in repeats for r in rs if (r.experiment, r.run) == key
                and r.ttft_p90_ms and r.sim_ttft_p90_ms is not None]
        if not rows:
            continue
        real = [r.ttft_p90_ms or 0.0 for r in rows]
        mean_real = statistics.fmean(real)
        sim = statistics.fmean(r.sim_ttft_p90_ms or 0.0 for r in rows)
        within += abs(sim / mean_real - 1.0) <= MAX_TTFT_RATIO_ERROR
        if max(abs(x / mean_real - 1.0) for x in real) > MAX_TTFT_RATIO_ERROR:
            wide.append(f"{key[0]}/{key[1]} {min(real):.0f}-{max(real):.0f} ms")
    tolerance = f"{100 * MAX_TTFT_RATIO_ERROR:.0f}%"
    return (f"per configuration, the simulated TTFT p90's mean over the repeats is within {tolerance} of the real "
            f"one's in {within}/{len(keys)}; the real p90 itself moves more than {tolerance} from its mean "
            f"between repeats in {len(wide)}/{len(keys)}" + (f" ({', '.join(wide)})" if wide else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.policy_repeats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="policy_compare --out directories, one per repeat")
    args = parser.parse_args(argv)
    repeats = [load(json.loads((d / "summary.json").read_text())) for d in args.runs]
    print("\n".join(table(repeats)))
    print()
    for v in verdicts(repeats):
        print(f"{'PASS' if v.passed else 'FAIL'}  {v.name}: {v.detail}")
    for context in (host_speed_context(repeats), per_configuration_context(repeats)):
        if context is not None:
            print(f"(context) {context}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
