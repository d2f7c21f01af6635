"""A worker's profile, decode table and step noise fitted to its tapped pure engine steps.

The fit behind the policy simulator's replays of real runs (lab/experiments/simulate.py says why each
part is as it is): one model for a worker's steps by non-negative least squares,

    step_s = a*[prefill] + b*prefill_tokens + c*attention + d*[decode] + e*batch + f*context

with the prefill part fitted to every worker's pure prefill steps together (`fit_workers`), the median
pure decode step per batch size as a table (a CPU's decode step is not linear in the batch), and the
residuals' robust relative spread as the simulator's step noise. The rows are the scheduler tap's step
samples: (kind, t, x, y, seconds), kind "prefill" (x tokens, y attention or 0), "decode" (x batch, y
context tokens) or "mixed" (left out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.core.cost_model import WorkerProfile

_MIN_TABLE_SAMPLES = 5  # decode steps of one batch size needed for its own table entry
_FEATURE_SCALES = np.array([1.0, 1e3, 1e6, 1.0, 1e1, 1e4])

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


def fit_workers(steps: Mapping[str, Sequence[tuple[np.ndarray, float]]]) -> dict[str, FittedWorker]:
    """One fit per worker, from its own steps plus every other worker's pure prefill steps: the
    workers run the same engine with the same flags, and a busy batching worker runs almost every
    prompt inside a mixed step (not in this fit), so alone it leaves its prefill cost unobserved."""
    prefills = {wid: [s for s in rows if s[0][0] == 1.0] for wid, rows in steps.items()}
    return {wid: fit_worker([*rows, *(s for other, p in prefills.items() if other != wid for s in p)])
            for wid, rows in steps.items()}
