"""Fit a served step's cost beyond `baton profile`'s runner time, from a bench run's token gaps.

    python -m loadtest.experiments.serving_cost --profile profile.json RUN.json [RUN.json ...]

Each RUN.json is a `baton bench` result of a cluster with ONE decode worker that runs no prefill
(e.g. the 3P1D layout of loadtest/micro/layouts_suite.sh), so every streamed sequence is in that
worker's batch and every token gap is one of its steps. From the records alone: at each token gap,
the batch is the sequences between their first and last token, and their context their prompt plus
tokens so far. Per batch bucket (8 wide, >= 200 gaps) the median gap minus the profile's decode
step is the excess; a line through the buckets gives `per_step_s` + `per_seq_s` x batch, the
`ServingCost` (scheduler/sim/serving.py) that `baton plan --serving-step-ms/--serving-seq-us` takes.
Gaps that also hold a hand-off commit or a coalesced event stay in: the median keeps them out.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.records import RequestRecord
from loadtest.report import load_result
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


def token_times(record: RequestRecord) -> list[float]:
    if not record.ok or record.ttft is None:
        return []
    times = [record.send_time + record.ttft]
    for gap in record.chunk_gaps:
        times.append(times[-1] + gap)
    return times


def gaps(records: Sequence[RequestRecord]) -> list[Gap]:
    """Every token gap with the decode batch and context at its start."""
    streams = [(t, r.prompt_tokens or r.prompt_len) for r in records if len(t := token_times(r)) > 1]
    out = []
    for times, _ in streams:
        for a, b in zip(times[:-1], times[1:], strict=True):
            batch, context = 0, 0.0
            for other, prompt in streams:
                if other[0] <= a < other[-1]:
                    batch += 1
                    context += prompt + bisect.bisect_right(other, a)
            out.append(Gap(a, b - a, batch, context))
    return out


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


def fit(rows: Sequence[Bucket]) -> ServingCost:
    """Least squares of excess on batch; a negative term is clipped to 0 (the runner already covers it)."""
    if len(rows) < 2:
        raise ValueError(f"need >= 2 batch buckets of >= {MIN_GAPS} gaps; got {len(rows)}")
    xs, ys = [b.batch for b in rows], [b.excess_s for b in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return ServingCost(per_step_s=max(intercept, 0.0), per_seq_s=max(slope, 0.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.experiments.serving_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="baton bench result JSON files (one decode worker)")
    p.add_argument("--profile", type=Path, required=True, help="the `baton profile` of that worker")
    args = p.parse_args(argv)
    from scheduler.adapters.profiles import ProfileBook

    profile = next(iter(ProfileBook.load(args.profile).by_model.values()))
    rows: list[Bucket] = []
    for path in args.runs:
        records = [r for run in load_result(path).runs for r in run.records]
        for b in buckets(gaps(records), profile):
            rows.append(b)
            runner_ms = (b.gap_s - b.excess_s) * 1e3
            print(f"{path.name:32s} batch {b.batch:5.1f}  context/seq {b.context_per_seq:5.0f}  gap p50 "
                  f"{b.gap_s * 1e3:5.1f} ms  profile {runner_ms:5.1f} ms  excess {b.excess_s * 1e3:5.1f} ms")
    try:
        cost = fit(rows)
    except ValueError as e:
        print(f"serving_cost: {e}", file=sys.stderr)
        return 2
    print(f"serving cost: {cost.per_step_s * 1e3:.2f} ms per step + {cost.per_seq_s * 1e6:.0f} us per sequence "
          f"(baton plan --serving-step-ms {cost.per_step_s * 1e3:.2f} --serving-seq-us {cost.per_seq_s * 1e6:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
