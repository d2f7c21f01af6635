"""A served prefill step's two cost terms beyond the runner's, fitted by replaying measured runs.

`ServingCost`'s prefill terms (per step that carries prefill, per prompt whose prefill ends in the
step) are chosen so that the simulated remote prefills' mean `prefill_compute` matches the measured
mean per run, in count-weighted least squares: Gauss-Newton with a finite-difference Jacobian, both
terms >= 0. The caller supplies the simulator (lab/experiments/prefill_serving_cost.py replays each run
through `baton plan`'s simulator); one-chunk and four-chunk prompts tell the two terms apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

STEP_S = 0.005  # finite-difference step of the Jacobian (the terms are near-linear in the simulated means)
ITERATIONS = 4  # Gauss-Newton rounds: the first lands within ~1 ms, the rest confirm

PrefillTerms = tuple[float, float]  # (per prefill step, per prompt done), seconds
# Each run's simulated mean prefill_compute (seconds) with the given terms, in the measured order.
SimulatedMeans = Callable[[PrefillTerms], list[float]]


def fit_prefill_terms(simulate: SimulatedMeans, measured_s: Sequence[float], weights: Sequence[float]) -> PrefillTerms:
    """(per prefill step, per prompt done) >= 0 minimising the `weights`-weighted squared gap between
    `simulate(terms)` and `measured_s`."""
    terms = (0.0, 0.0)
    for _ in range(ITERATIONS):
        base = simulate(terms)
        columns = [[(v - b) / STEP_S for v, b in zip(simulate(_shifted(terms, i)), base, strict=True)]
                   for i in range(2)]
        gaps = [m - b for m, b in zip(measured_s, base, strict=True)]
        step = weighted_least_squares(columns, gaps, weights)
        terms = (max(terms[0] + step[0], 0.0), max(terms[1] + step[1], 0.0))
    return terms


def _shifted(terms: PrefillTerms, index: int) -> PrefillTerms:
    return (terms[0] + STEP_S, terms[1]) if index == 0 else (terms[0], terms[1] + STEP_S)


def weighted_least_squares(columns: Sequence[Sequence[float]], target: Sequence[float],
                           weights: Sequence[float]) -> tuple[float, float]:
    """argmin_x sum w (a x - y)^2 for two columns a (the 2x2 normal equations; ridge-free: the runs'
    one-step and four-step prompts make the columns independent). Falls back to the first column
    alone when they are not."""
    (a, b) = columns
    aa = sum(w * x * x for w, x in zip(weights, a, strict=True))
    bb = sum(w * x * x for w, x in zip(weights, b, strict=True))
    ab = sum(w * x * y for w, x, y in zip(weights, a, b, strict=True))
    ay = sum(w * x * y for w, x, y in zip(weights, a, target, strict=True))
    by = sum(w * x * y for w, x, y in zip(weights, b, target, strict=True))
    det = aa * bb - ab * ab
    if abs(det) <= 1e-12 * max(aa * bb, 1e-30):
        return (ay / aa if aa else 0.0, 0.0)
    return ((ay * bb - by * ab) / det, (by * aa - ay * ab) / det)
