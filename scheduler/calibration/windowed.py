"""Least squares over a sliding window of samples, ridge-regularised towards prior coefficients: the
online fit behind each worker's cost model (scheduler/core/cost_model.py says why the ridge is
relative to the data). Pure Python: the systems are 3x3.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

_MIN_RELATIVE_VAR = 1e-2  # see WindowedLeastSquares._penalty
_TINY = 1e-12  # keeps the penalty positive for a feature that is 0 throughout the window
MIN_SEEN_SAMPLES = 3  # samples of one value of the tracked feature before it counts as seen
# How many samples a tracked value's own mean residual needs to be trusted half (`residual_at`): a
# value seen n times keeps n / (n + this) of its residual, the rest stays with the line.
RESIDUAL_SHRINK_SAMPLES = 3.0


class _SlidingMax:
    """The largest value among the samples in a first-in-first-out window: entries of (arrival
    number, value) kept with values decreasing, so the front is the maximum and each sample is
    pushed and dropped at most once."""

    def __init__(self) -> None:
        self._entries: deque[tuple[int, float]] = deque()
        self._arrived = 0
        self._left = 0

    def push(self, value: float) -> None:
        while self._entries and self._entries[-1][1] <= value:
            self._entries.pop()  # never the maximum again: `value` arrived later and stays longer
        self._entries.append((self._arrived, value))
        self._arrived += 1

    def pop_oldest(self) -> None:
        if self._entries and self._entries[0][0] == self._left:
            self._entries.popleft()
        self._left += 1

    @property
    def value(self) -> float | None:
        return self._entries[0][1] if self._entries else None


@dataclass
class _Group:
    """The window's samples at one value of the tracked feature: their count and sums."""

    count: int = 0
    features: list[float] = field(default_factory=list)
    target: float = 0.0

    def add(self, x: tuple[float, ...], target: float, sign: int) -> None:
        if not self.features:
            self.features = [0.0] * len(x)
        self.count += sign
        self.target += sign * target
        for i, xi in enumerate(x):
            self.features[i] += sign * xi


class WindowedLeastSquares:
    """Least squares over the last `window` samples, regularised towards `prior` coefficients.

    The normal equations are kept as running sums of raw features (a sample's outer product is
    added on arrival and subtracted when it leaves the window), so a refit is a small k-by-k solve
    however large the window. The sums are rebuilt from the window once per `window` samples to
    stop floating-point drift from accumulating. `prior_weight` is how many samples the prior is
    worth (see the module docstring). The first feature must be the constant 1 (the fixed cost).
    """

    def __init__(
        self,
        prior: tuple[float, ...],
        window: int,
        prior_weight: float,
        tracked: int | None = None,
        bounded: int | None = None,
    ) -> None:
        """`tracked`: the index of a feature whose values the window groups its samples by (see
        `largest_seen` and `residual_at`). `bounded`: the index of a feature whose largest value in
        the window `largest_bounded` reports."""
        if window <= 0 or prior_weight <= 0:
            raise ValueError("need window > 0 and prior_weight > 0")
        self._tracked = tracked
        self._bounded = bounded
        self._bound = _SlidingMax()
        self._groups: dict[float, _Group] = {}  # tracked feature value -> its samples in the window
        self._largest_seen: float | None = None  # cached `largest_seen`, None when stale
        self._values: list[float] | None = None  # sorted group keys, None when stale
        self._residuals: dict[float, float] = {}  # `residual_at` per value asked, until the next sample
        self._prior = prior
        self._prior_weight = prior_weight
        self._window = window
        self._samples: deque[tuple[tuple[float, ...], float]] = deque()
        self._since_rebuild = 0
        self._xtx = [[0.0] * len(prior) for _ in prior]
        self._xty = [0.0] * len(prior)
        self._coefficients = tuple(prior)
        self._dirty = False
        self.version = 0  # samples added so far: what a caller caching the coefficients compares

    def add(self, features: tuple[float, ...], target: float) -> None:
        if len(features) != len(self._prior) or features[0] != 1.0:
            raise ValueError(f"expected {len(self._prior)} features, the first the constant 1.0")
        self._samples.append((features, target))
        self._accumulate(features, target, 1.0)
        self._group(features, target, 1)
        if self._bounded is not None:
            self._bound.push(features[self._bounded])
        if len(self._samples) > self._window:
            old, old_target = self._samples.popleft()
            self._accumulate(old, old_target, -1.0)
            self._group(old, old_target, -1)
            self._bound.pop_oldest()
        self._since_rebuild += 1
        self.version += 1
        if self._since_rebuild >= self._window:
            self._rebuild()
        self._dirty = True

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def largest_seen(self) -> float:
        """The largest value of the tracked feature with `MIN_SEEN_SAMPLES` in the window (0: none)."""
        if self._largest_seen is None:
            self._largest_seen = max(
                (v for v, g in self._groups.items() if g.count >= MIN_SEEN_SAMPLES), default=0.0
            )
        return self._largest_seen

    def largest_bounded(self) -> float | None:
        """The largest value of the `bounded` feature in the window (None: no samples, or no such
        feature)."""
        return self._bound.value

    def residual_at(self, value: float) -> float:
        """What the window's samples at this value of the tracked feature say the fitted line misses
        there: their mean residual, shrunk towards 0 by `RESIDUAL_SHRINK_SAMPLES` (a value seen once
        is mostly noise). Between seen values it is interpolated, outside them the nearest one's.

        The line carries what varies smoothly (context length, the trend in batch size); this carries
        the shape a line cannot: a CPU's decode step is not linear in batch size (docs/benchmarks.md,
        scheduler policies: 84 / 158 / 194 / 159 ms at 1-4 sequences, which a line over-prices at 4 by
        ~20%). 0 without a tracked feature or samples."""
        coefficients = self.coefficients  # refits, and clears the cache below, when stale
        cached = self._residuals.get(value)  # routing asks for the same few sizes between heartbeats
        if cached is None:
            cached = self._residuals[value] = self._interpolated_residual(value, coefficients)
        return cached

    def _interpolated_residual(self, value: float, coefficients: tuple[float, ...]) -> float:
        values = self._sorted_values()
        if not values:
            return 0.0
        i = bisect.bisect_left(values, value)
        if i < len(values) and values[i] == value or i == 0 or i == len(values):
            return self._residual(values[min(i, len(values) - 1)], coefficients)
        lo, hi = values[i - 1], values[i]
        weight = (value - lo) / (hi - lo)
        return (1 - weight) * self._residual(lo, coefficients) + weight * self._residual(hi, coefficients)

    def _residual(self, value: float, coefficients: tuple[float, ...]) -> float:
        group = self._groups[value]
        line = _dot(coefficients, group.features)
        return (group.target - line) / (group.count + RESIDUAL_SHRINK_SAMPLES)

    def _sorted_values(self) -> list[float]:
        if self._values is None:
            self._values = sorted(self._groups)
        return self._values

    def _group(self, features: tuple[float, ...], target: float, sign: int) -> None:
        if self._tracked is None:
            return
        value = features[self._tracked]
        group = self._groups.get(value)
        if group is None:
            group = self._groups[value] = _Group()
            self._values = None
        group.add(features, target, sign)
        if not group.count:
            del self._groups[value]
            self._values = None
        self._largest_seen = None

    @property
    def coefficients(self) -> tuple[float, ...]:
        # Refit lazily: heartbeats bring many samples, routing asks for few predictions in between.
        if self._dirty:
            self._coefficients = self._solve()
            self._residuals = {}
            self._dirty = False
        return self._coefficients

    def _accumulate(self, x: tuple[float, ...], target: float, sign: float) -> None:
        for i, xi in enumerate(x):
            self._xty[i] += sign * xi * target
            row = self._xtx[i]
            for j, xj in enumerate(x):
                row[j] += sign * xi * xj

    def _rebuild(self) -> None:
        self._xtx = [[0.0] * len(self._prior) for _ in self._prior]
        self._xty = [0.0] * len(self._prior)
        self._groups = {}
        self._values = None
        for x, target in self._samples:
            self._accumulate(x, target, 1.0)
            self._group(x, target, 1)
        self._since_rebuild = 0

    def _penalty(self) -> list[list[float]]:
        """The ridge's quadratic form P (penalty = prior_weight * d'Pd, d = theta - prior), from the
        window's feature means mu and variances var: P = mu mu' + diag(var).

        That is `prior_weight` samples' worth of evidence on each direction the data can see, in
        the data's own units: mu mu' holds the prediction at the window's mean sizes, diag(var)
        holds each per-unit cost over the spread of sizes actually seen (the standardised-feature
        ridge, with features centred so the fixed term is not collinear with the others). A
        variance is floored at `_MIN_RELATIVE_VAR` of the feature's mean square: a feature that
        never varies in the window (always batch 1) is collinear with the fixed term, and the
        floor keeps its per-unit cost at the prior while the fixed term absorbs what the data
        say about their sum, which predicts the sizes actually seen exactly.
        """
        n = len(self._samples)
        k = len(self._prior)
        mu = [self._xtx[0][j] / n for j in range(k)]  # feature 0 is the constant 1
        var = []
        for j in range(k):
            mean_sq = self._xtx[j][j] / n
            var.append(max(mean_sq - mu[j] ** 2, _MIN_RELATIVE_VAR * mean_sq, _TINY))
        return [[mu[i] * mu[j] + (var[i] if i == j else 0.0) for j in range(k)] for i in range(k)]

    def _solve(self) -> tuple[float, ...]:
        if not self._samples:
            return tuple(self._prior)
        penalty = self._penalty()
        free = list(range(len(self._prior)))
        theta = [0.0] * len(self._prior)
        # Every true coefficient is a cost, so a negative one is noise: pin it at 0 and refit the
        # others (clamping alone would leave them fitted around the negative value, e.g. long
        # prompts predicted cheaper than short ones). At most k rounds: one pin per round.
        while free:
            solved = self._solve_free(free, penalty)
            negative = [i for i in free if solved[i] < 0]
            theta = [max(v, 0.0) for v in solved]
            if not negative:
                break
            free.remove(min(negative, key=lambda i: solved[i] * math.sqrt(self._xtx[i][i])))
        return tuple(theta)

    def _solve_free(self, free: list[int], penalty: list[list[float]]) -> list[float]:
        """(X'X + lam P) theta = X'y + lam P prior over the `free` coefficients, the others held
        at 0. The system is solved Jacobi-scaled (tokens**2 reaches 1e8, its sums 1e18)."""
        lam = self._prior_weight
        prior = self._prior
        a = [[self._xtx[i][j] + lam * penalty[i][j] for j in free] for i in free]
        b = [
            self._xty[i] + lam * _dot(penalty[i], prior) for i in free
        ]
        scale = [math.sqrt(a[r][r]) for r in range(len(free))]
        a = [[v / (scale[r] * scale[c]) for c, v in enumerate(row)] for r, row in enumerate(a)]
        b = [v / scale[r] for r, v in enumerate(b)]
        theta = [0.0] * len(prior)
        for r, value in enumerate(_solve_spd(a, b)):
            theta[free[r]] = value / scale[r]
        return theta


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination for the small symmetric positive-definite systems above (no pivoting
    needed: the ridge term keeps every pivot positive)."""
    n = len(b)
    a = [row[:] for row in a]
    b = b[:]
    for k in range(n):
        for i in range(k + 1, n):
            factor = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= factor * a[k][j]
            b[i] -= factor * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - _dot(a[i][i + 1 :], x[i + 1 :])) / a[i][i]
    return x


def _dot(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The plain left-to-right sum of products. Not `sum()`: from Python 3.12 it sums floats with
    compensation, so the same fit would give other last bits on 3.11, on 3.12, and compiled
    (scheduler/native.py; mypyc's `sum` adds plainly), and decisions near a tie would differ."""
    total = 0.0
    for x, y in zip(xs, ys, strict=True):
        total += x * y
    return total
