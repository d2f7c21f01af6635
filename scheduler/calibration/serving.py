"""A served decode step's cost beyond the runner's (`ServingCost`), fitted from token gaps.

With ONE decode worker that runs no prefill, every streamed sequence is in that worker's batch and
every token gap is one of its steps. Per batch bucket (`BUCKET` wide, >= `MIN_GAPS` gaps) the median
gap minus the profile's decode step is the excess; a line through the buckets gives `per_step_s` +
`per_seq_s` x batch, the `ServingCost` (scheduler/sim/serving.py) that `baton plan
--serving-step-ms/--serving-seq-us` takes. Gaps that also hold a hand-off commit or a coalesced event
stay in: the median keeps them out. lab/experiments/serving_cost.py reads the gaps from bench runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.serving import ServingCost

BUCKET = 8
MIN_GAPS = 200


@dataclass(frozen=True)
class Gap:
    at: float  # when the step started (the previous token)
    seconds: float
    batch: int
    context_tokens: float


@dataclass(frozen=True)
class Bucket:
    batch: float  # mean batch of the bucket's gaps
    context_per_seq: float
    gap_s: float  # median
    excess_s: float  # median gap minus the profile's decode step


def buckets(all_gaps: Sequence[Gap], profile: WorkerProfile) -> list[Bucket]:
    out = []
    for low in range(1, max((g.batch for g in all_gaps), default=0) + 1, BUCKET):
        inside = [g for g in all_gaps if low <= g.batch < low + BUCKET]
        if len(inside) < MIN_GAPS:
            continue
        batch = statistics.fmean(g.batch for g in inside)
        context = statistics.fmean(g.context_tokens for g in inside)
        median = statistics.median(g.seconds for g in inside)
        out.append(Bucket(batch, context / batch, median, median - profile.decode_step_s(round(batch), round(context))))
    return out


def fit_serving_cost(rows: Sequence[Bucket]) -> ServingCost:
    """Least squares of excess on batch; a negative term is clipped to 0 (the runner already covers it)."""
    if len(rows) < 2:
        raise ValueError(f"need >= 2 batch buckets of >= {MIN_GAPS} gaps; got {len(rows)}")
    xs, ys = [b.batch for b in rows], [b.excess_s for b in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return ServingCost(per_step_s=max(intercept, 0.0), per_seq_s=max(slope, 0.0))
