"""Fit a served step's cost beyond `baton profile`'s runner time, from a bench run's token gaps.

    python -m lab.experiments.serving_cost --profile profile.json RUN.json [RUN.json ...]

Each RUN.json is a `baton bench` result of a cluster with ONE decode worker that runs no prefill
(e.g. the 3P1D layout of lab/suites/layouts_suite.sh), so every streamed sequence is in that
worker's batch and every token gap is one of its steps. From the records alone: at each token gap,
the batch is the sequences between their first and last token, and their context their prompt plus
tokens so far. The fit itself (buckets of gaps, the line through their excess over the
profile) is scheduler/calibration/serving.py; this reads the gaps from the runs and prints it.
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.records import RequestRecord
from loadtest.report import load_result
from scheduler.calibration.serving import Bucket, Gap, buckets, fit_serving_cost


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.experiments.serving_cost", description=__doc__,
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
        cost = fit_serving_cost(rows)
    except ValueError as e:
        print(f"serving_cost: {e}", file=sys.stderr)
        return 2
    print(f"serving cost: {cost.per_step_s * 1e3:.2f} ms per step + {cost.per_seq_s * 1e6:.0f} us per sequence "
          f"(baton plan --serving-step-ms {cost.per_step_s * 1e3:.2f} --serving-seq-us {cost.per_seq_s * 1e6:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
