"""From a real run's scheduler tap to a replay: fitted worker profiles, the trace, the simulated run.

Profiles. A `both` worker reports a mixed step (prefill chunks + decodes in one forward pass) as a
prefill sample AND a decode sample that both carry the whole step's seconds (services/worker/
heartbeat.py). Fitting the two halves separately would charge every mixed step twice, so steps
are rebuilt first (a prefill sample followed by a decode sample with the same seconds is one step)
and one model is fitted to all of them by non-negative least squares:

    step_s = a*[prefill] + b*prefill_tokens + c*attention + d*[decode] + e*batch + f*context

which is exactly how `scheduler.sim.worker.SimWorker` prices a step (prefill part + decode part).
The residuals' relative spread becomes the simulator's step noise.

Workers. `MirroredSimWorker` reports what the real `both` worker reports, not what an ideal one
would: mixed steps as two samples with the full step time each, and `inflight_prefill_tokens = 0`
(a `both` worker has no prefill service to count its queued prompts; services/worker/server.py).
The scheduler in the simulator then learns from the same (biased) signal as the real one. It is
swapped in by subclassing the replay driver (`scheduler.replay._Replay`), whose constructor builds
plain `SimWorker`s; everything else is the replay code unchanged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import make_policy
from scheduler.core.scheduler import SchedulerConfig
from scheduler.replay import ReplayConfig, _Replay
from scheduler.sim.trace import Arrival
from scheduler.sim.worker import SimWorker, SimWorkerSpec
from scheduler.types import SLO, DecodeSample, PrefillSample, Tier, WorkerRole, WorkerSnapshot

_WARMUP_STEPS = 2  # a worker's first steps include lazy initialisation; not representative
_FEATURE_SCALES = np.array([1.0, 1e3, 1e6, 1.0, 1e1, 1e4])


@dataclass(frozen=True)
class FittedWorker:
    profile: WorkerProfile
    noise: float  # relative std of the residuals
    steps: int  # steps the fit used
    mean_abs_rel_err: float  # in-sample, of the fitted step time


def rebuild_steps(rows: Sequence[Sequence[Any]]) -> list[tuple[np.ndarray, float]]:
    """(features, seconds) per engine step, from one worker's tapped sample rows in order."""
    steps: list[tuple[np.ndarray, float]] = []
    i = 0
    while i < len(rows):
        kind, _, x, y, seconds = rows[i]
        f = np.zeros(6)
        if kind == "prefill":
            f[0:3] = (1.0, x, y if y else x * x)
            nxt = rows[i + 1] if i + 1 < len(rows) else None
            if nxt is not None and nxt[0] == "decode" and nxt[4] == seconds:
                f[3:6] = (1.0, nxt[2], nxt[3])
                i += 1
        else:
            f[3:6] = (1.0, x, y)
        steps.append((f, float(seconds)))
        i += 1
    return steps


def fit_worker(steps: Sequence[tuple[np.ndarray, float]]) -> FittedWorker:
    if len(steps) < 8:
        raise ValueError(f"only {len(steps)} step samples: too few to fit a profile")
    x = np.stack([f for f, _ in steps]) / _FEATURE_SCALES
    y = np.array([s for _, s in steps])
    coef = _nnls(x, y) / _FEATURE_SCALES
    pred = np.maximum((np.stack([f for f, _ in steps]) * coef).sum(axis=1), 1e-4)
    rel = (y - pred) / pred
    noise = float(np.clip(1.4826 * np.median(np.abs(rel - np.median(rel))), 0.02, 0.5))  # robust std
    a, b, c, d, e, f = (float(v) for v in coef)
    profile = WorkerProfile(prefill_fixed_s=a, prefill_per_token_s=b, prefill_per_token_sq_s=c, decode_fixed_s=d,
                            decode_per_seq_s=e, decode_per_context_token_s=f, transfer_fixed_s=0.0,
                            transfer_per_token_s=0.0)
    return FittedWorker(profile, noise, len(steps), float(np.mean(np.abs(rel))))


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
    output length = max_tokens (the benchmark runs with ignore_eos)."""
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
    return sorted(seen.values(), key=lambda a: a.time_s)


def tier_slos(tap: Mapping[str, Any], default: SLO) -> dict[Tier, SLO]:
    """The SLO the gateway sent for each tier (every request of a tier carries the same)."""
    slos = {t: default for t in Tier}
    for r in tap["routes"]:
        q = r["request"]
        slos[Tier(q["tier"])] = SLO(q["ttft_ms"], q["tpot_ms"])
    return slos


class MirroredSimWorker(SimWorker):
    """A simulated `both` worker that reports like the real one (see the module docstring)."""

    def start_step(self, now: float) -> float | None:
        before = len(self._samples)
        seconds = super().start_step(now)
        new = self._samples[before:]
        if seconds is not None and len(new) == 2:  # a mixed step: both samples carry the whole step
            self._samples[before:] = [replace(s, seconds=seconds) for s in new
                                      if isinstance(s, PrefillSample | DecodeSample)]
        return seconds

    def heartbeat(self, now: float) -> tuple[WorkerSnapshot, list, list]:  # type: ignore[type-arg]
        snapshot, samples, events = super().heartbeat(now)
        if self.spec.role is WorkerRole.BOTH:
            snapshot = replace(snapshot, inflight_prefill_tokens=0)
        return snapshot, samples, events


class _ExperimentReplay(_Replay):
    def __init__(self, trace: Sequence[Arrival], workers: Sequence[SimWorkerSpec], policy_name: str,
                 slos: Mapping[Tier, SLO], config: ReplayConfig, noise: Mapping[str, float], mirror: bool) -> None:
        super().__init__(trace, workers, make_policy(policy_name), slos.__getitem__, config)
        rng = random.Random(config.seed)
        cls = MirroredSimWorker if mirror else SimWorker
        self.workers = {w.worker_id: cls(w, rng, noise.get(w.worker_id, config.step_noise)) for w in workers}


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
             slos: Mapping[Tier, SLO], noise: Mapping[str, float], *, seed: int = 0, mirror: bool = True,
             heartbeat_interval_s: float = 0.2, seed_profile: WorkerProfile | None = None) -> SimRun:
    """One replay; the scheduler's cost models start from `seed_profile` (as `--profile` gave the real
    one) or from the core's default profile, never from the simulated truth."""
    core = SchedulerConfig(default_profile=seed_profile or WorkerProfile())
    config = ReplayConfig(heartbeat_interval_s=heartbeat_interval_s, tick_interval_s=0.05, seed=seed,
                          seed_profiles=False, scheduler=core)
    run = _ExperimentReplay(trace, workers, policy_name, slos, config, noise, mirror)
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


def worker_specs(tap: Mapping[str, Any], fitted: Mapping[str, FittedWorker], max_num_seqs: Mapping[str, int],
                 max_prefill_tokens: int = 2048) -> list[SimWorkerSpec]:
    """One simulated `both` worker per real one: same KV pool, batch limit and fitted step times."""
    specs = []
    for worker_id, w in sorted(tap["workers"].items()):
        specs.append(SimWorkerSpec(worker_id, WorkerRole(w["role"]), fitted[worker_id].profile,
                                   total_blocks=w["total_blocks"], block_size=w["block_size"],
                                   max_batch=max_num_seqs[worker_id], max_prefill_tokens=max_prefill_tokens,
                                   cache_blocks=w["total_blocks"], model=w["model"]))
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
