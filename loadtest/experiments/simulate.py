"""From a real run's scheduler tap to a replay: fitted worker profiles, the trace, the simulated run.

Samples. A real worker reports only pure steps (services/worker/heartbeat.py): a step that mixes
prefill chunks with decodes is not reported at all, so every tapped row is one whole step.

Profiles. One model is fitted to a worker's steps by non-negative least squares,

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
signal as the real one. The replay driver (`scheduler.replay._Replay`) is subclassed only to give each
worker its fitted noise; everything else is the replay code unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from loadtest.experiments.mixed_steps import ServedRequest, decode_share, first_token_overhead, mixed_steps
from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import make_policy
from scheduler.core.scheduler import SchedulerConfig
from scheduler.replay import Clients, ReplayConfig, _Replay
from scheduler.sim.host import STEADY, HostSpeed
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, link_turns
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole

_WARMUP_STEPS = 2  # a worker's first steps include lazy initialisation; not representative
_MIN_TABLE_SAMPLES = 5  # decode steps of one batch size needed for its own table entry
_FEATURE_SCALES = np.array([1.0, 1e3, 1e6, 1.0, 1e1, 1e4])
HOST_WINDOW_S = 5.0  # see `host_speeds`
_MIN_WINDOW_STEPS = 3  # decode steps a window needs for its own speed factor


@dataclass(frozen=True)
class FittedWorker:
    profile: WorkerProfile
    decode_step_s: tuple[float, ...]  # median pure decode step by batch size (index = batch - 1)
    noise: float  # relative std of the residuals
    steps: int  # steps the fit used
    mean_abs_rel_err: float  # in-sample, of the fitted step time
    mixed_decode_share: float = 1.0  # see mixed_steps.py; 1.0 until measured

    def prefill_s(self, prompts: Sequence[int]) -> float:
        """The prefill part of a step that computes these whole, uncached prompts."""
        p = self.profile
        return (p.prefill_fixed_s + p.prefill_per_token_s * sum(prompts)
                + p.prefill_per_token_sq_s * sum(n * n for n in prompts))

    def decode_s(self, batch: int) -> float:
        table = self.decode_step_s
        return table[batch - 1] if 0 < batch <= len(table) else self.profile.decode_step_s(batch, 0)


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


def rebuild_steps(rows: Sequence[Sequence[Any]]) -> list[tuple[np.ndarray, float]]:
    """(features, seconds) per pure engine step, from one worker's tapped sample rows in order (mixed
    steps are left out: `with_mixed_shares` prices them)."""
    steps: list[tuple[np.ndarray, float]] = []
    for kind, _, x, y, seconds in (row for row in rows if row[0] != "mixed"):
        f = np.zeros(6)
        if kind == "prefill":
            f[0:3] = (1.0, x, y if y else x * x)
        else:
            f[3:6] = (1.0, x, y)
        steps.append((f, float(seconds)))
    return steps


def fit_worker(steps: Sequence[tuple[np.ndarray, float]]) -> FittedWorker:
    if len(steps) < 8:
        raise ValueError(f"only {len(steps)} step samples: too few to fit a profile")
    features = np.stack([f for f, _ in steps])
    y = np.array([s for _, s in steps])
    coef = _nnls(features / _FEATURE_SCALES, y) / _FEATURE_SCALES
    a, b, c, d, e, f = (float(v) for v in coef)
    profile = WorkerProfile(prefill_fixed_s=a, prefill_per_token_s=b, prefill_per_token_sq_s=c, decode_fixed_s=d,
                            decode_per_seq_s=e, decode_per_context_token_s=f, transfer_fixed_s=0.0,
                            transfer_per_token_s=0.0)
    table = decode_table(steps)
    pred = np.array([_priced(profile, table, f) for f in features])
    rel = (y - pred) / pred
    noise = float(np.clip(1.4826 * np.median(np.abs(rel - np.median(rel))), 0.02, 0.5))  # robust std
    return FittedWorker(profile, table, noise, len(steps), float(np.mean(np.abs(rel))))


def decode_table(steps: Sequence[tuple[np.ndarray, float]]) -> tuple[float, ...]:
    """Median pure decode step seconds per batch size, 1..the largest batch with enough samples; the
    sizes in between with too few are interpolated linearly. Empty when no size has enough."""
    by_batch: dict[int, list[float]] = {}
    for f, seconds in steps:
        if f[0] == 0 and f[3] == 1.0:
            by_batch.setdefault(int(f[4]), []).append(seconds)
    known = {b: float(np.median(v)) for b, v in by_batch.items() if len(v) >= _MIN_TABLE_SAMPLES}
    if not known:
        return ()
    sizes = sorted(known)
    return tuple(float(v) for v in np.interp(range(1, sizes[-1] + 1), sizes, [known[b] for b in sizes]))


def _priced(profile: WorkerProfile, table: Sequence[float], f: np.ndarray) -> float:
    """A pure step's simulated time: decodes from the table where it covers the batch."""
    if f[0] == 0 and 0 < f[4] <= len(table):
        return table[int(f[4]) - 1]
    return max(float((f * _profile_coefficients(profile)).sum()), 1e-4)


def _profile_coefficients(p: WorkerProfile) -> np.ndarray:
    return np.array([p.prefill_fixed_s, p.prefill_per_token_s, p.prefill_per_token_sq_s, p.decode_fixed_s,
                     p.decode_per_seq_s, p.decode_per_context_token_s])


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (costs): drop the most negative and refit."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if not active:
            return coef
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[active] = sol
        if (sol >= 0).all():
            return coef
        active.pop(int(np.argmin(sol)))


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


class _ExperimentReplay(_Replay):
    def __init__(self, trace: Sequence[Arrival], workers: Sequence[SimWorkerSpec], policy_name: str,
                 slos: Mapping[Tier, SLO], config: ReplayConfig, noise: Mapping[str, float]) -> None:
        super().__init__(trace, workers, make_policy(policy_name), slos.__getitem__, config)
        rng = random.Random(config.seed)
        self.workers = {w.worker_id: SimWorker(w, rng, noise.get(w.worker_id, config.step_noise)) for w in workers}


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
    run = _ExperimentReplay(trace, workers, policy_name, slos, config, noise)
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


def fit_workers(steps: Mapping[str, Sequence[tuple[np.ndarray, float]]]) -> dict[str, FittedWorker]:
    """One fit per worker, from its own steps plus every other worker's pure prefill steps: the
    workers run the same engine with the same flags, and a busy batching worker runs almost every
    prompt inside a mixed step (not in this fit), so alone it leaves its prefill cost unobserved."""
    prefills = {wid: [s for s in rows if s[0][0] == 1.0] for wid, rows in steps.items()}
    return {wid: fit_worker([*rows, *(s for other, p in prefills.items() if other != wid for s in p)])
            for wid, rows in steps.items()}


def pooled_steps(taps: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[np.ndarray, float]]]:
    """Each worker id's steps over several runs (same flags each run), each run's warm-up dropped."""
    pooled: dict[str, list[tuple[np.ndarray, float]]] = {}
    for tap in taps:
        for worker_id, rows in tap["samples"].items():
            pooled.setdefault(worker_id, []).extend(rebuild_steps(rows)[_WARMUP_STEPS:])
    return pooled


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
