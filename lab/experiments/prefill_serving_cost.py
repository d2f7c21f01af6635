"""Fit a served prefill step's cost beyond `baton profile`'s runner time, by replaying measured runs.

    python -m lab.experiments.prefill_serving_cost OUT_A [OUT_B ...] --out DIR [--profile F]

OUT_*: outputs of `lab/suites/layouts_suite.sh` whose summary.json holds the prefill workers'
hand-off phases. Unlike the decode side (serving_cost.py, from token gaps), a prefill worker's steps
are not in the records: each run keeps only the `prefill_compute` phase per prompt (first chunk
scheduled -> first token, a histogram per prefill worker), and which prompts shared a step is not
known. So every disaggregated run at its workload's lowest rate (queues near empty: the phase is
step costs, not a backlog) is replayed on its own request stream through `baton plan`'s simulator
(layout_replay.py), and `ServingCost`'s two prefill terms (per step that carries prefill, per prompt
whose prefill ends in the step) are fitted so that the simulated remote prefills' mean
`prefill_compute` matches the measured mean per run, in count-weighted least squares
(scheduler/calibration/prefill_serving.py). One-chunk
(ShareGPT) and four-chunk (random 2k) prompts tell the two terms apart. Prints each run's means
without and with the terms.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.experiments import layout_check
from lab.experiments.layout_replay import PREFILL_COMPUTE, measured_phase_mean, replay_run
from scheduler.calibration.prefill_serving import PrefillTerms, fit_prefill_terms
from scheduler.core.cost_model import WorkerProfile
from scheduler.planner import PlanConfig


@dataclass(frozen=True)
class MeasuredCompute:
    run: str
    count: int  # remote prefills the prefill workers timed
    mean_s: float  # their mean prefill_compute


def measured_compute(meta: dict[str, Any], run: str) -> MeasuredCompute | None:
    """The prefill workers' count-weighted mean `prefill_compute` of one run (None without any)."""
    found = measured_phase_mean(meta, run, PREFILL_COMPUTE)
    return None if found is None else MeasuredCompute(run, found[0], found[1] / 1e3)


def lowest_rate_runs(runs: Sequence[Path]) -> list[Path]:
    """Per (layout, workload), the run at the lowest rate."""
    lowest: dict[tuple[str, str], Path] = {}
    for path in runs:
        layout, workload, rate = path.stem.split("__")
        key = (layout, workload)
        if key not in lowest or float(rate[1:]) < float(lowest[key].stem.split("__r")[-1]):
            lowest[key] = path
    return sorted(lowest.values())


def simulated_means_s(paths: Sequence[Path], profile: WorkerProfile, config: PlanConfig,
                      terms: PrefillTerms) -> list[float]:
    """Each run's simulated mean prefill_compute of its remote prefills, with (per step, per prompt done)."""
    serving = dataclasses.replace(config.serving, per_prefill_step_s=terms[0], per_prefill_done_s=terms[1])
    means = []
    for path in paths:
        _, result = replay_run(path, profile, dataclasses.replace(config, serving=serving))
        values = [o.prefill_compute_s for o in result.outcomes if o.prefill_compute_s is not None]
        means.append(statistics.fmean(values) if values else 0.0)
    return means


def fit(paths: Sequence[Path], measured: Sequence[MeasuredCompute], profile: WorkerProfile,
        config: PlanConfig) -> PrefillTerms:
    """The two terms fitted so that the replays' mean prefill_compute meets the measured ones
    (scheduler/calibration/prefill_serving.py)."""
    return fit_prefill_terms(lambda terms: simulated_means_s(paths, profile, config, terms),
                             [m.mean_s for m in measured], [m.count for m in measured])


def main(argv: list[str] | None = None) -> int:
    args, profile_path = layout_check.parse_args("lab.experiments.prefill_serving_cost", __doc__, argv)
    profile = layout_check.load_profile(profile_path)
    with tempfile.TemporaryDirectory(prefix="prefill-cost-") as tmp:
        meta = layout_check.merge_runs(args.outs, Path(tmp))
        config = PlanConfig(gpus=1, slo=layout_check.run_slo(args, meta), max_batch=128,
                            kv_blocks_per_gpu=int(meta.get("num_blocks") or 20480), handoff_s=layout_check.HANDOFF_S)
        chosen = [(p, m) for p in lowest_rate_runs(sorted((Path(tmp) / "runs").glob("*.json")))
                  if (m := measured_compute(meta, p.stem)) is not None]
        if not chosen:
            print("prefill_serving_cost: no run with prefill workers' prefill_compute phases", file=sys.stderr)
            return 2
        paths, measured = [p for p, _ in chosen], [m for _, m in chosen]
        without = simulated_means_s(paths, profile, config, (0.0, 0.0))
        terms = fit(paths, measured, profile, config)
        fitted = simulated_means_s(paths, profile, config, terms)
    for m, zero, at_fit in zip(measured, without, fitted, strict=True):
        print(f"{m.run:26s} remote {m.count:4d}  prefill_compute mean: measured {m.mean_s * 1e3:6.1f} ms, "
              f"simulated {zero * 1e3:6.1f} ms without the terms, {at_fit * 1e3:6.1f} ms with them")
    print(f"served prefill: +{terms[0] * 1e3:.1f} ms per step that carries prefill, +{terms[1] * 1e3:.1f} ms per "
          f"prompt done (baton plan --serving-prefill-step-ms {terms[0] * 1e3:.1f} "
          f"--serving-prefill-done-ms {terms[1] * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
