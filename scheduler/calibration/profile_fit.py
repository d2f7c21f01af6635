"""Fit the cost model's coefficients to measured step times: non-negative least squares in relative error.

Relative: the grid's step times span two or three orders of magnitude, and an ordinary fit would
spend its freedom on the longest prompts and leave the shortest (whose TTFT targets are the
tightest) off by a factor. Each row is divided by its measured time, so the fit minimises the sum of
squared relative errors. A bonus on a shared host: a step slowed 10x by a neighbour adds at most 1
to the loss (its prediction cannot go below 0), so it pulls the fit far less than in an absolute fit.

Prefill has a floor (scheduler/core/cost_model.py): an eager forward costs the same up to a few
hundred tokens, then grows along a line. `fit_prefill` tries each prompt size as the last one on the
floor (the floor: those points' relative-least-squares level; the line: the fit to the rest) and
keeps the split, or no floor, with the smallest loss over all points, so the data place the knee.

Non-negative: every coefficient is a cost. A negative fixed cost fitted from noise would make short
steps look free and draw every request to this worker (the online refit clamps the same way).

Solver: the NNLS optimum is the unconstrained least-squares solution on the subset of columns it
leaves positive (KKT: the free coefficients zero the gradient, the others are zero). With three
features that is 7 subsets: solve each, keep the best whose coefficients are all positive. Exact, and
far shorter than Lawson-Hanson's active-set loop. Pure Python, no torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.calibration.points import DecodePoint, Measurements, PrefillPoint
from scheduler.core.cost_model import WorkerProfile

_MAX_FEATURES = 8  # 2**k subsets: fine for the cost model's 3, absurd for a general regression
_SINGULAR = 1e-12  # pivot below this (columns are unit-norm) means the subset's columns are dependent
# A point off its fit by more than this was most likely slowed by something else on the host: the
# cost model is smooth in every feature, and an idle machine fits within a few percent.
OUTLIER = 0.5


@dataclass(frozen=True)
class LinearFit:
    coefficients: tuple[float, ...]  # >= 0, one per feature
    relative_errors: tuple[float, ...]  # (predicted - measured) / measured, one per point
    floor_s: float = 0.0  # predicted = max(floor_s, features . coefficients); 0: the plain line


@dataclass(frozen=True)
class PhaseFits:
    prefill: LinearFit
    decode: LinearFit


def fit_measurements(measured: Measurements) -> PhaseFits:
    if not measured.prefill or not measured.decode:
        raise ValueError("the KV pool holds none of the prefill or decode points; raise --num-blocks")
    return PhaseFits(
        prefill=fit_prefill([p for p, _ in measured.prefill], [s for _, s in measured.prefill]),
        decode=fit_decode([d for d, _ in measured.decode], [s for _, s in measured.decode]),
    )


def outliers(measured: Measurements, fits: PhaseFits) -> list[PrefillPoint | DecodePoint]:
    """Points further than OUTLIER (relative) from their fit."""
    far: list[PrefillPoint | DecodePoint] = [
        p for (p, _), e in zip(measured.prefill, fits.prefill.relative_errors, strict=True) if abs(e) > OUTLIER]
    far += [d for (d, _), e in zip(measured.decode, fits.decode.relative_errors, strict=True) if abs(e) > OUTLIER]
    return far


def prefill_features(p: PrefillPoint) -> tuple[float, float, float]:
    """(1, tokens, attention): `WorkerProfile.prefill_s`'s terms."""
    return (1.0, float(p.new_tokens), float(p.attention_tokens_sq))


def decode_features(p: DecodePoint) -> tuple[float, float, float]:
    """(1, batch, context tokens): `WorkerProfile.decode_step_s`'s terms."""
    return (1.0, float(p.batch), float(p.context_tokens))


def fit_prefill(points: Sequence[PrefillPoint], seconds: Sequence[float]) -> LinearFit:
    """The line alone, or a floor up to some prompt size and the line above it: the smaller loss."""
    best = fit_nonnegative([prefill_features(p) for p in points], seconds)
    for knee in sorted({p.new_tokens for p in points})[:-1]:
        split = _floor_then_line(points, seconds, knee)
        if split is not None and _loss(split) < _loss(best):
            best = split
    return best


def _floor_then_line(points: Sequence[PrefillPoint], seconds: Sequence[float], knee: int) -> LinearFit | None:
    """Points of <= `knee` new tokens on a floor, the line fitted to the others; None unless two
    sizes or more lie on each side (a floor is a level several sizes share, a line needs two sizes
    to have a slope: one point alone fits anything exactly, and would always win)."""
    low = [y for p, y in zip(points, seconds, strict=True) if p.new_tokens <= knee]
    high = [(p, y) for p, y in zip(points, seconds, strict=True) if p.new_tokens > knee]
    sizes = [len({p.new_tokens for p in points if (p.new_tokens <= knee) == below}) for below in (True, False)]
    if min(sizes) < 2:
        return None
    floor = sum(1 / y for y in low) / sum(1 / y**2 for y in low)  # minimises sum(((floor - y) / y)**2)
    line = fit_nonnegative([prefill_features(p) for p, _ in high], [y for _, y in high])
    predicted = [max(floor, _dot(prefill_features(p), line.coefficients)) for p in points]
    errors = tuple(f / y - 1.0 for f, y in zip(predicted, seconds, strict=True))
    return LinearFit(line.coefficients, errors, floor)


def _loss(fit: LinearFit) -> float:
    return sum(e * e for e in fit.relative_errors)


def fit_decode(points: Sequence[DecodePoint], seconds: Sequence[float]) -> LinearFit:
    return fit_nonnegative([decode_features(p) for p in points], seconds)


def build_profile(prefill: LinearFit, decode: LinearFit, transfer_fixed_s: float | None = None,
                  transfer_per_token_s: float | None = None) -> WorkerProfile:
    """The fitted coefficients; transfer terms stay at WorkerProfile's defaults unless given
    (they are measured by lab/micro/bench_kv_transfer.py, between two workers, not here)."""
    a, b, c = prefill.coefficients
    d, e, f = decode.coefficients
    default = WorkerProfile()
    return WorkerProfile(
        prefill_fixed_s=a, prefill_per_token_s=b, prefill_per_token_sq_s=c, prefill_floor_s=prefill.floor_s,
        decode_fixed_s=d, decode_per_seq_s=e, decode_per_context_token_s=f,
        transfer_fixed_s=default.transfer_fixed_s if transfer_fixed_s is None else transfer_fixed_s,
        transfer_per_token_s=default.transfer_per_token_s if transfer_per_token_s is None else transfer_per_token_s,
    )


def with_prefill(profile: WorkerProfile, prefill: LinearFit) -> WorkerProfile:
    """`profile` with its prefill terms (and floor) refitted; decode and transfer terms kept."""
    a, b, c = prefill.coefficients
    return replace(profile, prefill_fixed_s=a, prefill_per_token_s=b, prefill_per_token_sq_s=c,
                   prefill_floor_s=prefill.floor_s)


def fit_nonnegative(features: Sequence[Sequence[float]], measured: Sequence[float]) -> LinearFit:
    """Coefficients x >= 0 minimising sum(((features[i] . x) - measured[i]) / measured[i])**2."""
    _check_inputs(features, measured)
    rows = [[v / y for v in row] for row, y in zip(features, measured, strict=True)]
    ones = [1.0] * len(rows)  # measured / measured
    k = len(features[0])
    best, best_residual = (0.0,) * k, _residual(rows, ones, (0.0,) * k)  # all-zero is always feasible
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            x = _least_squares_on(rows, ones, subset, k)
            if x is None or any(x[j] <= 0 for j in subset):
                continue
            residual = _residual(rows, ones, x)
            if residual < best_residual:
                best, best_residual = x, residual
    errors = tuple(_dot(row, best) / y - 1.0 for row, y in zip(features, measured, strict=True))
    return LinearFit(best, errors)


def _check_inputs(features: Sequence[Sequence[float]], measured: Sequence[float]) -> None:
    if not features or len(features) != len(measured):
        raise ValueError(f"need one measured time per feature row, got {len(features)} rows, {len(measured)} times")
    k = len(features[0])
    if not 1 <= k <= _MAX_FEATURES or any(len(row) != k for row in features):
        raise ValueError(f"every row needs the same 1..{_MAX_FEATURES} features")
    if any(not (y > 0 and math.isfinite(y)) for y in measured):
        raise ValueError("measured times must be positive and finite")


def _least_squares_on(rows: list[list[float]], target: list[float], subset: tuple[int, ...],
                      k: int) -> tuple[float, ...] | None:
    """Unconstrained least squares on the `subset` columns (others zero); None if they are dependent.

    Columns are scaled to unit norm first: the raw features run from 1 to ~1e8 (tokens squared),
    and the normal equations of unscaled columns lose every digit of the small coefficients.
    """
    cols = [[row[j] for row in rows] for j in subset]
    norms = [math.sqrt(_dot(c, c)) for c in cols]
    if any(n == 0 for n in norms):
        return None
    cols = [[v / n for v in c] for c, n in zip(cols, norms, strict=True)]
    gram = [[_dot(ci, cj) for cj in cols] for ci in cols]
    rhs = [_dot(ci, target) for ci in cols]
    solved = _solve(gram, rhs)
    if solved is None:
        return None
    x = [0.0] * k
    for j, value, n in zip(subset, solved, norms, strict=True):
        x[j] = value / n
    return tuple(x)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the matrix is (numerically) singular."""
    n = len(b)
    m = [row[:] + [bi] for row, bi in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < _SINGULAR:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def _residual(rows: list[list[float]], target: list[float], x: Sequence[float]) -> float:
    return sum((_dot(row, x) - t) ** 2 for row, t in zip(rows, target, strict=True))


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))
