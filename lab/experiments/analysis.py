"""Real-run figures (baton bench results + the scheduler tap) next to the simulator's, as tables.

Real goodput fraction = requests that completed within both SLOs / requests attempted (rejected
and failed ones are misses), from `baton bench`'s records; goodput req/s is the bench's (good
requests per second of run). Simulated figures are means over `SIM_SEEDS` noise seeds.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lab.experiments.mixed_steps import ServedRequest, pair_requests
from lab.experiments.simulate import (
    ExperimentFit,
    SimRun,
    fit_experiment,
    host_speeds,
    simulate,
    tier_slos,
    trace_from_tap,
    worker_specs,
)
from loadtest.metrics import distribution_ms, latency_samples
from loadtest.report import load_result
from scheduler.core.cost_model import WorkerProfile
from scheduler.replay import Clients
from scheduler.types import SLO

SIM_SEEDS = (0, 1, 2, 3, 4)


@dataclass
class RealRun:
    label: str
    policy: str
    tap: dict[str, Any]
    benches: dict[str, dict[str, Any]]  # label -> bench summary of its one run
    tiers: dict[str, str]  # label -> tier
    fallbacks: int
    seed_profile: WorkerProfile | None  # what the real scheduler's cost models started from (None: default)
    load_avg: float | None  # mean 1-minute load average while the benchmark ran (machine-wide)
    latencies: dict[str, list[float]]  # "ttft" / "tpot" -> seconds, every bench's requests together
    served: list[ServedRequest]  # every bench's requests with the worker that served them


def load_run(run_dir: Path, run: Any, experiment: Any) -> RealRun:
    benches, tiers = {}, {}
    latencies: dict[str, list[float]] = {"ttft": [], "tpot": []}
    served: list[ServedRequest] = []
    tap = json.loads((run_dir / "scheduler_tap.json").read_text())
    for spec in experiment.benches:
        result = load_result(run_dir / f"{spec.label}.json")
        benches[spec.label] = result.summaries()[0]
        tiers[spec.label] = spec.tier
        records = result.runs[0].records
        for kind, values in latency_samples(records).items():
            latencies.setdefault(kind, []).extend(values)
        served += pair_requests(placed_routes(tap, spec.tier), records, templated=spec.chat)
    fallbacks_file = run_dir / "gateway_fallbacks.txt"
    fallbacks = int(fallbacks_file.read_text()) if fallbacks_file.exists() else -1
    seed = run_dir / "seed_profile.json"
    profile = WorkerProfile.load(seed) if seed.exists() else None
    loads = run_dir / "loadavg.txt"
    samples = [float(line.split()[0]) for line in loads.read_text().splitlines()] if loads.exists() else []
    load_avg = statistics.fmean(samples) if samples else None
    return RealRun(run.label, run.policy, tap, benches, tiers, fallbacks, profile, load_avg, latencies, served)


def placed_routes(tap: Mapping[str, Any], tier: str) -> list[dict[str, Any]]:
    """A tier's routes, a queued request's with the decision that later placed or rejected it."""
    first = {r["request"]["request_id"]: r for r in tap["routes"] if r["request"]["tier"] == tier}
    for d in tap["late_decisions"]:
        rid = d["decision"]["request_id"]
        if rid in first:
            first[rid] = {**first[rid], "decision": d["decision"]}
    return list(first.values())


def scheduler_decisions(tap: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Per tier: first answers by kind, then how queued requests ended (placed / rejected)."""
    tier_of = {r["request"]["request_id"]: r["request"]["tier"] for r in tap["routes"]}
    out: dict[str, Counter[str]] = {}
    for r in tap["routes"]:
        out.setdefault(r["request"]["tier"], Counter())[r["decision"]["kind"]] += 1
    for d in tap["late_decisions"]:
        tier = tier_of.get(d["decision"]["request_id"], "?")
        out.setdefault(tier, Counter())[f"after_queue_{d['decision']['kind']}"] += 1
    return {t: dict(c) for t, c in out.items()}


def real_placements(tap: Mapping[str, Any]) -> dict[str, int]:
    decisions = [r["decision"] for r in tap["routes"]] + [d["decision"] for d in tap["late_decisions"]]
    return dict(Counter(d["decode"] for d in decisions if d["decode"] is not None))


def _real_row(run: RealRun) -> dict[str, Any]:
    good = sum(s["good_requests"] for s in run.benches.values())
    total = sum(s["num_requests"] for s in run.benches.values())
    first = next(iter(run.benches.values()))
    # Over every bench's requests together, as the simulator's are (with two benches, e.g. exp3's two
    # tiers, the first bench's p90 alone compared one tier's real TTFT with both tiers' simulated).
    ttft_p90, tpot_p90 = (distribution_ms(run.latencies[k])["p90"] for k in ("ttft", "tpot"))
    by_tier = {run.tiers[label]: {"goodput_fraction": s["goodput_fraction"], "goodput_rps": s["goodput"],
                                  "ttft_p90_ms": s["ttft_ms"]["p90"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                                  "tpot_p90_ms": s["tpot_ms"]["p90"], "requests": s["num_requests"],
                                  "completed": s["completed"], "errors": s["errors"]}
               for label, s in run.benches.items()}
    return {"goodput_fraction": good / total if total else 0.0, "good": good, "requests": total,
            "goodput_rps": sum(s["goodput"] for s in run.benches.values()),
            "ttft_p90_ms": ttft_p90, "tpot_p90_ms": tpot_p90,
            "prefix_hit_rate": first["prefix_cache"]["hit_rate"], "by_tier": by_tier,
            "errors": {k: v for s in run.benches.values() for k, v in s["errors"].items()},
            "placements": real_placements(run.tap), "decisions": scheduler_decisions(run.tap),
            "gateway_fallbacks": run.fallbacks, "routed_by_scheduler": len(run.tap["routes"]),
            "load_avg": run.load_avg, "engine_step_ms": engine_step_ms(run.tap)}


def engine_step_ms(tap: Mapping[str, Any]) -> float | None:
    """How fast the machine ran the engines during a run: the median pure decode step of one sequence,
    every worker's together (None: no such step). The same work whatever the policy (the one-slot
    worker runs nothing else), so two runs' values compare the host, not the policies: on the shared
    2-core machine this swung 0.84-1.31x between the runs of one repeat (docs/benchmarks.md, pass P)."""
    steps = [row[4] for rows in tap["samples"].values() for row in rows if row[0] == "decode" and row[2] == 1]
    return 1e3 * statistics.median(steps) if steps else None


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _sim_row(sims: Sequence[SimRun]) -> dict[str, Any]:
    fractions = [s.goodput_fraction for s in sims]
    tiers = sorted({t for s in sims for t in s.by_tier})
    by_tier = {t: {k: _mean([s.by_tier[t][k] for s in sims if t in s.by_tier])
                   for k in ("goodput_fraction", "ttft_p90_ms", "rejected")} for t in tiers}
    placements: Counter[str] = Counter()
    for s in sims:
        placements.update(s.placements)
    return {"goodput_fraction": statistics.fmean(fractions), "goodput_fraction_min": min(fractions),
            "goodput_fraction_max": max(fractions), "goodput_rps": _mean([s.goodput_rps for s in sims]),
            "ttft_p90_ms": _mean([s.ttft_p90_ms for s in sims]), "tpot_p90_ms": _mean([s.tpot_p90_ms for s in sims]),
            "prefix_hit_rate": _mean([s.prefix_hit_rate for s in sims]), "rejected": _mean([s.rejected for s in sims]),
            "by_tier": by_tier, "placements": {k: v / len(sims) for k, v in sorted(placements.items())}}


def _simulate_run(run: RealRun, fit: ExperimentFit, max_num_seqs: Mapping[str, int],
                  clients: Clients | None, host_replayed: bool = False) -> dict[str, Any]:
    """`host_replayed`: every step at the speed the run's host ran the worker at that time (`host_speeds`)."""
    trace = trace_from_tap(run.tap)
    slos = tier_slos(run.tap, SLO(1e9, 1e9))
    speeds = host_speeds(run.tap, fit.workers) if host_replayed else None
    specs = worker_specs(run.tap, fit.workers, max_num_seqs, speeds=speeds)
    noise = {wid: f.noise for wid, f in fit.workers.items()}
    sims = [simulate(trace, specs, run.policy, slos, noise, seed=s, seed_profile=run.seed_profile,
                     client_overhead_s=fit.client_overhead_s, clients=clients) for s in SIM_SEEDS]
    return {**_sim_row(sims), "requests": len(trace)}


def analyse_experiment(out: Path, experiment: Any, max_num_seqs: Mapping[str, int],
                       clients: Clients | None = None) -> dict[str, Any]:
    runs = [load_run(experiment.run_dir(out, r), r, experiment) for r in experiment.runs
            if (experiment.run_dir(out, r) / "scheduler_tap.json").exists()]
    fit = fit_experiment([r.tap for r in runs], [s for r in runs for s in r.served])
    speeds = {r.label: engine_step_ms(r.tap) for r in runs}
    measured = [s for s in speeds.values() if s is not None]
    reference = statistics.median(measured) if measured else None
    rows = {}
    for run in runs:
        real, sim = _real_row(run), _simulate_run(run, fit, max_num_seqs, clients)
        # The same replay with profiles fitted to this run's samples alone: it carries the background
        # load of that run, so the gap between the two errors is how much the load drifted.
        own = fit_experiment([run.tap], run.served)
        own_sim = _simulate_run(run, own, max_num_seqs, clients)
        good = real["goodput_fraction"]
        rows[run.label] = {"real": real, "sim": sim, "sim_own_fit": own_sim,
                           "sim_error_pp": 100 * (sim["goodput_fraction"] - good),
                           "sim_own_fit_error_pp": 100 * (own_sim["goodput_fraction"] - good),
                           "own_fit_profiles": {wid: asdict(f.profile) for wid, f in own.workers.items()}}
        # And the experiment's fit with every step at the speed this run's host ran it at, window by
        # window: the shared host's speed drifts between runs and within one by more than the policies
        # differ (docs/benchmarks.md, passes Q and R). Context for the verdicts, which use `sim`.
        replayed = _simulate_run(run, fit, max_num_seqs, clients, host_replayed=True)
        rows[run.label] |= {"sim_host_replayed": replayed,
                            "sim_host_replayed_error_pp": 100 * (replayed["goodput_fraction"] - good)}
        speed = speeds[run.label]
        if speed is not None and reference:
            rows[run.label]["host_speed"] = speed / reference
    profiles = {wid: {**asdict(f.profile), "noise": f.noise, "steps": f.steps, "decode_step_s": f.decode_step_s,
                      "mixed_decode_share": f.mixed_decode_share,
                      "mean_abs_rel_err": f.mean_abs_rel_err} for wid, f in fit.workers.items()}
    real_scheduler_fits = {r.label: r.tap["fitted_profiles"] for r in runs}
    return {"runs": rows, "fitted_profiles": profiles, "client_overhead_s": fit.client_overhead_s,
            "real_scheduler_fits": real_scheduler_fits}


def analyse(out: Path, plan: Sequence[Any], max_num_seqs: Mapping[str, int],
            clients: Clients | None = None) -> dict[str, Any]:
    summary = {e.name: analyse_experiment(out, e, max_num_seqs, clients) for e in plan
               if any(e.run_dir(out, r).exists() for r in e.runs)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print_tables(summary)
    return summary


def _f(v: Any, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _host_replayed(row: Mapping[str, Any]) -> str:
    if "sim_host_replayed" not in row or "host_speed" not in row:
        return "-"
    replayed = row["sim_host_replayed"]
    return (f"x{row['host_speed']:.2f}: {_pct(replayed['goodput_fraction'])} "
            f"({row['sim_host_replayed_error_pp']:+.1f}), TTFT p90 {_f(replayed['ttft_p90_ms'])}")


def _split(placements: Mapping[str, float]) -> str:
    return "/".join(_f(placements.get(w, 0), ".0f") for w in ("worker-a", "worker-b"))


def print_tables(summary: Mapping[str, Any]) -> None:
    print("\n| experiment | run | real goodput (req/s) | real good % | sim good % [min-max] | sim error (pp) "
          "| sim own-fit good % (error) | host replayed (run's speed): sim good % (error), TTFT p90 ms "
          "| TTFT p90 real/sim (ms) "
          "| TPOT p90 real/sim (ms) | placed a/b real/sim | gw fallbacks | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, exp in summary.items():
        for policy, row in exp["runs"].items():
            r, s = row["real"], row["sim"]
            print(f"| {name} | {policy} | {r['goodput_rps']:.3f} | {_pct(r['goodput_fraction'])} "
                  f"| {_pct(s['goodput_fraction'])} "
                  f"[{_pct(s['goodput_fraction_min'])}-{_pct(s['goodput_fraction_max'])}] "
                  f"| {row['sim_error_pp']:+.1f} "
                  f"| {_pct(row['sim_own_fit']['goodput_fraction'])} ({row['sim_own_fit_error_pp']:+.1f}) "
                  f"| {_host_replayed(row)} "
                  f"| {_f(r['ttft_p90_ms'])}/{_f(s['ttft_p90_ms'])} "
                  f"| {_f(r['tpot_p90_ms'])}/{_f(s['tpot_p90_ms'])} "
                  f"| {_split(r['placements'])} / {_split(s['placements'])} | {r['gateway_fallbacks']} "
                  f"| {_f(r['load_avg'], '.1f')} |")
    _print_prefix(summary)
    _print_tiers(summary)
    _print_profiles(summary)


def _print_prefix(summary: Mapping[str, Any]) -> None:
    print("\n| experiment | policy | real prefix hit rate | sim prefix hit rate |")
    print("|---|---|---|---|")
    for name, exp in summary.items():
        for policy, row in exp["runs"].items():
            print(f"| {name} | {policy} | {_pct(row['real']['prefix_hit_rate'])} "
                  f"| {_pct(row['sim']['prefix_hit_rate'])} |")


def _print_tiers(summary: Mapping[str, Any]) -> None:
    print("\n| experiment | policy | tier | requests | real good % | real TTFT p50/p90 (ms) | real errors "
          "| scheduler decisions | sim good % | sim TTFT p90 (ms) | sim rejected |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, exp in summary.items():
        for policy, row in exp["runs"].items():
            for tier, t in row["real"]["by_tier"].items():
                s = row["sim"]["by_tier"].get(tier, {})
                errors = ", ".join(f"{k}: {v}" for k, v in t["errors"].items()) or "none"
                decisions = ", ".join(f"{k}: {v}" for k, v in row["real"]["decisions"].get(tier, {}).items())
                print(f"| {name} | {policy} | {tier} | {t['requests']} | {_pct(t['goodput_fraction'])} "
                      f"| {_f(t['ttft_p50_ms'])}/{_f(t['ttft_p90_ms'])} | {errors} | {decisions} "
                      f"| {_pct(s.get('goodput_fraction'))} | {_f(s.get('ttft_p90_ms'))} "
                      f"| {_f(s.get('rejected'), '.1f')} |")


def _print_profiles(summary: Mapping[str, Any]) -> None:
    print("\n| experiment | worker | prefill a (ms) | b (ms/token) | c (ns/token^2) | decode d (ms) | e (ms/seq) "
          "| f (us/ctx token) | noise | steps | fit MAE |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, exp in summary.items():
        for wid, p in exp["fitted_profiles"].items():
            print(f"| {name} | {wid} | {1e3 * p['prefill_fixed_s']:.1f} | {1e3 * p['prefill_per_token_s']:.3f} "
                  f"| {1e9 * p['prefill_per_token_sq_s']:.2f} | {1e3 * p['decode_fixed_s']:.1f} "
                  f"| {1e3 * p['decode_per_seq_s']:.2f} | {1e6 * p['decode_per_context_token_s']:.2f} "
                  f"| {p['noise']:.2f} | {p['steps']} | {100 * p['mean_abs_rel_err']:.0f}% |")
