"""From a real run's scheduler tap to a replay: fitted worker profiles, the trace, the simulated run.

Samples. A real worker reports only pure steps (services/worker/heartbeat.py): a step that mixes
prefill chunks with decodes is not reported at all, so every tapped row is one whole step.

Profiles (the fit: scheduler/calibration/step_fit.py). One model is fitted to a worker's steps by
non-negative least squares,

    step_s = a*[prefill] + b*prefill_tokens + c*attention + d*[decode] + e*batch + f*context

which is how `scheduler.sim.worker.SimWorker` prices a step: prefill part + decode part, and for a
mixed step (never reported) prefill part + a share of the decode part, the share measured from the
client's token gaps (mixed_steps.py; ~0.3 here: one forward pass carries both). The prefill part
is fitted to every worker's pure prefill steps together (same engine, same flags): a busy batching
worker runs almost every prompt inside a mixed step, and its own few pure prefills gave fits from
0 to 520 ms of fixed cost between repeats.

The pure decode steps are also tabulated: the median step time per batch size becomes the
simulated worker's `decode_step_s`, because on this CPU (torch, one thread per worker) a decode
step is not linear in the batch. Measured on the three
quiet repeats of docs/benchmarks.md: about 80 ms at batch 1, 140 at 2, 175 at 3, then 120-150 ms
for 4 to 8 sequences, while the linear fit said 98/122/146/170/194 ms for 1-5. Batch sizes with
too few samples are interpolated between their neighbours; beyond the last the profile prices.
The residuals' relative spread (against the table for decodes, the fit for prefills) becomes the
simulator's step noise.

Host. `host_speeds` measures, per worker and 5-s window of a run, how much slower or faster than the fit
its decode steps ran; a replay given them (`worker_specs(..., speeds=...)`) prices every step at that
speed (scheduler/sim/host.py). Replays judged against the runs use the fit alone: the host's drift is
what a prediction cannot know, and the replay with it says how much of an error is that drift.

Workers. The simulated workers report what the real `both` worker reports: no sample for a mixed
step, its engine's pending prefill and, since 2026-11-27, its running sequences' summed context (before
that the real scheduler priced every decode batch at zero context while the simulated one did not, one
cause of their online fits ending far apart). The scheduler in the simulator then learns from the same
signal as the real one. The replay driver (`scheduler.replay.ReplayRun`) is given each worker's fitted
noise; everything else is the replay code unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from lab.experiments.mixed_steps import ServedRequest, decode_share, first_token_overhead, mixed_steps
from scheduler.calibration.step_fit import FittedWorker, fit_workers, rebuild_steps
from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import make_policy
from scheduler.core.scheduler import SchedulerConfig
from scheduler.replay import Clients, ReplayConfig, ReplayRun
from scheduler.sim.host import STEADY, HostSpeed
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, link_turns
from scheduler.types import SLO, Tier, WorkerRole

_WARMUP_STEPS = 2  # a worker's first steps include lazy initialisation; not representative
HOST_WINDOW_S = 5.0  # see `host_speeds`
_MIN_WINDOW_STEPS = 3  # decode steps a window needs for its own speed factor


@dataclass(frozen=True)
class ExperimentFit:
    """Everything the replay of an experiment's runs takes from the real runs."""

    workers: dict[str, FittedWorker]
    client_overhead_s: float  # see mixed_steps.first_token_overhead; 0 where too few were seen


def fit_experiment(taps: Sequence[Mapping[str, Any]], served: Sequence[ServedRequest]) -> ExperimentFit:
    """Profiles and decode tables from the tapped steps, mixed-step shares and the client's first-token
    overhead from the bench's timings of the same requests."""
    workers = with_mixed_shares(fit_workers(pooled_steps(taps)), served)
    overhead = first_token_overhead(served, lambda wid, n: workers[wid].prefill_s([n]))
    return ExperimentFit(workers, overhead or 0.0)


def with_mixed_shares(fitted: Mapping[str, FittedWorker], requests: Sequence[ServedRequest]) -> dict[str, FittedWorker]:
    """Each worker's fit with the decode share of its mixed steps as the client timed them
    (mixed_steps.py); unchanged where too few were seen (a one-slot worker never mixes)."""
    out = {}
    for wid, f in fitted.items():
        share = decode_share(mixed_steps(requests, wid), f.prefill_s, f.decode_s)
        out[wid] = f if share is None else replace(f, mixed_decode_share=share)
    return out


def trace_from_tap(tap: Mapping[str, Any]) -> list[Arrival]:
    """Requests as the scheduler received them (first Route per id), times from the first arrival;
    output length = max_tokens (the benchmark runs with ignore_eos); each conversation turn with the
    blocks its answer fills (`link_turns`, at the workers' block size)."""
    routes = tap["routes"]
    seen: dict[str, Arrival] = {}
    t0 = min((r["t"] for r in routes), default=0.0)
    for r in routes:
        q = r["request"]
        if q["request_id"] in seen:
            continue
        seen[q["request_id"]] = Arrival(
            time_s=r["t"] - t0, request_id=q["request_id"], prompt_tokens=q["prompt_tokens"],
            output_tokens=q["max_tokens"], prefix_hashes=tuple(q["prefix_hashes"]), tier=Tier(q["tier"]),
            conversation_id=q["conversation_id"])
    trace = sorted(seen.values(), key=lambda a: a.time_s)
    block_sizes = {w["block_size"] for w in tap["workers"].values()}
    return link_turns(trace, block_sizes.pop()) if len(block_sizes) == 1 else trace


def tier_slos(tap: Mapping[str, Any], default: SLO) -> dict[Tier, SLO]:
    """The SLO the gateway sent for each tier (every request of a tier carries the same)."""
    slos = {t: default for t in Tier}
    for r in tap["routes"]:
        q = r["request"]
        slos[Tier(q["tier"])] = SLO(q["ttft_ms"], q["tpot_ms"])
    return slos


def _experiment_replay(trace: Sequence[Arrival], workers: Sequence[SimWorkerSpec], policy_name: str,
                       slos: Mapping[Tier, SLO], config: ReplayConfig, noise: Mapping[str, float]) -> ReplayRun:
    return ReplayRun(trace, workers, make_policy(policy_name), slos.__getitem__, config, noise)


@dataclass(frozen=True)
class SimRun:
    policy: str
    requests: int
    good: int
    goodput_fraction: float
    goodput_rps: float  # good requests per simulated second (first arrival -> last event)
    rejected: int
    prefix_hit_rate: float | None
    by_tier: dict[str, dict[str, float | None]]  # tier -> goodput fraction, TTFT p90 (ms), rejected
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None
    placements: dict[str, int]  # decode worker -> requests


def simulate(trace: Sequence[Arrival], workers: Sequence[SimWorkerSpec], policy_name: str,
             slos: Mapping[Tier, SLO], noise: Mapping[str, float], *, seed: int = 0,
             heartbeat_interval_s: float = 0.2, seed_profile: WorkerProfile | None = None,
             client_overhead_s: float = 0.0, clients: Clients | None = None) -> SimRun:
    """One replay; the scheduler's cost models start from `seed_profile` (as `--profile` gave the real
    one) or from the core's default profile, never from the simulated truth. `clients`: when the
    run's clients gave up (None: never)."""
    core = SchedulerConfig(default_profile=seed_profile or WorkerProfile())
    config = ReplayConfig(heartbeat_interval_s=heartbeat_interval_s, tick_interval_s=0.05, seed=seed,
                          seed_profiles=False, scheduler=core, client_overhead_s=client_overhead_s,
                          clients=clients)
    run = _experiment_replay(trace, workers, policy_name, slos, config, noise)
    run.run()
    result = run.result(policy_name)
    served = [s for s in run.sequences.values() if s.first_token_at is not None]
    prompt = sum(s.arrival.prompt_tokens for s in served)
    hit = sum(s.decode_cached_tokens for s in served) / prompt if prompt else None
    good = sum(o.met_slo for o in result.outcomes)
    placements: dict[str, int] = {}
    for o in result.outcomes:
        if o.decode_worker_id is not None:
            placements[o.decode_worker_id] = placements.get(o.decode_worker_id, 0) + 1
    return SimRun(policy_name, len(result.outcomes), good, result.goodput, good / max(result.duration_s, 1e-9),
                  result.rejected, hit, _by_tier(result.outcomes), result.percentile_ms("ttft_s", 90),
                  result.percentile_ms("tpot_s", 90), placements)


def _by_tier(outcomes: Sequence[Any]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for tier in Tier:
        mine = [o for o in outcomes if o.tier is tier]
        if not mine:
            continue
        ttfts = sorted(o.ttft_s for o in mine if o.ttft_s is not None)
        p90 = float(np.percentile(ttfts, 90)) * 1e3 if ttfts else None
        out[tier.value] = {"goodput_fraction": sum(o.met_slo for o in mine) / len(mine), "ttft_p90_ms": p90,
                           "rejected": float(sum(o.rejected for o in mine)), "requests": float(len(mine))}
    return out


def host_speeds(tap: Mapping[str, Any], fitted: Mapping[str, FittedWorker],
                window_s: float = HOST_WINDOW_S) -> dict[str, HostSpeed]:
    """How fast each worker's host ran during the run, against the fit: per window of `window_s` from the
    first request (the replay's clock, `trace_from_tap`), the median of the worker's pure decode steps
    over the fit's step of their batch size. Batch size is divided out, so the factors follow the host,
    not the policy's loading (though a busier other worker on the same cores is part of the host).
    Windows with too few steps take the nearest measured one; a worker with none runs steady."""
    t0 = min((r["t"] for r in tap["routes"]), default=0.0)
    speeds = {}
    for worker_id, rows in tap["samples"].items():
        by_window: dict[int, list[float]] = {}
        for row in rows:
            if row[0] == "decode" and worker_id in fitted:
                ratio = row[4] / fitted[worker_id].decode_s(row[2])
                by_window.setdefault(int((row[1] - t0) // window_s), []).append(ratio)
        measured = {w: float(np.median(v)) for w, v in by_window.items() if w >= 0 and len(v) >= _MIN_WINDOW_STEPS}
        if not measured:
            speeds[worker_id] = STEADY
            continue
        known = sorted(measured)
        factors = tuple(measured[min(known, key=lambda k: (abs(k - w), k))] for w in range(known[-1] + 1))
        speeds[worker_id] = HostSpeed(window_s, factors)
    return speeds


def worker_specs(tap: Mapping[str, Any], fitted: Mapping[str, FittedWorker], max_num_seqs: Mapping[str, int],
                 max_prefill_tokens: int = 2048, speeds: Mapping[str, HostSpeed] | None = None) -> list[SimWorkerSpec]:
    """One simulated `both` worker per real one: same KV pool, batch limit and fitted step times; `speeds`:
    the host's speed over the run per worker (`host_speeds`; None: steady)."""
    specs = []
    for worker_id, w in sorted(tap["workers"].items()):
        specs.append(SimWorkerSpec(worker_id, WorkerRole(w["role"]), fitted[worker_id].profile,
                                   total_blocks=w["total_blocks"], block_size=w["block_size"],
                                   max_batch=max_num_seqs[worker_id], max_prefill_tokens=max_prefill_tokens,
                                   cache_blocks=w["total_blocks"], model=w["model"],
                                   decode_step_s=fitted[worker_id].decode_step_s,
                                   mixed_decode_share=fitted[worker_id].mixed_decode_share,
                                   host_speed=(speeds or {}).get(worker_id, STEADY)))
    return specs


def pooled_steps(taps: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[np.ndarray, float]]]:
    """Each worker id's steps over several runs (same flags each run), each run's warm-up dropped."""
    pooled: dict[str, list[tuple[np.ndarray, float]]] = {}
    for tap in taps:
        for worker_id, rows in tap["samples"].items():
            pooled.setdefault(worker_id, []).extend(rebuild_steps(rows)[_WARMUP_STEPS:])
    return pooled


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
