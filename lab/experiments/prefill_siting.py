"""Cost-based prefill siting vs the fixed token threshold, in the replay simulator (same core).

    .venv/bin/python -m lab.experiments.prefill_siting [--requests 400] [--seeds 0 1 2]
    .venv/bin/python -m lab.experiments.prefill_siting --smoke    # CI: 2 rates, 80 requests, 1 seed

A 1P3D cluster of one H100-class profile (8B shape; the hand-off at the measured 13 ms p50 overhead), a
mixed workload: 70% chat (64-768 prompt tokens, 32-256 out), 30% documents (2-6k tokens, 32-128 out), at
several rates. Both runs use the goodput policy; only the prefill siting differs: `cost` is
`scheduler/core/prefill_site.py`, `threshold` sends every prompt of >= 256 uncached tokens (and < 75% cached
on the decode worker) to the prefill worker, as the baselines do. Attainment at TTFT <= 1000 ms and TPOT <=
50 ms (and the share of prompts prefilled remotely) per rate, mean over seeds.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.cost_model import WorkerProfile
from scheduler.core.placement import (
    DecodeSide,
    DisaggregationRule,
    PrefillSide,
    cached_tokens,
    evaluate,
    prefill_side,
)
from scheduler.core.policies import GoodputPolicy
from scheduler.core.prefill_site import PrefillSiting, SiteChoice
from scheduler.replay import ReplayConfig, replay
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.types import SLO, RequestSummary, SiteReason, Tier, WorkerRole

CARD = WorkerProfile(prefill_fixed_s=0.005, prefill_per_token_s=3.2e-5, prefill_per_token_sq_s=1e-9,
                     decode_fixed_s=0.008, decode_per_seq_s=5e-5, decode_per_context_token_s=2e-8,
                     transfer_fixed_s=0.013, transfer_per_token_s=1e-6)
SLO_TARGET = SLO(ttft_ms=1000, tpot_ms=50)


class ThresholdSiting(PrefillSiting):
    """The fixed rule of the baselines, behind the siting interface."""

    def __init__(self, rule: DisaggregationRule | None = None) -> None:
        super().__init__()
        self._rule = rule or DisaggregationRule()

    def choose(self, request: RequestSummary, view: ClusterView, decode: WorkerLoad,
               pool: Sequence[PrefillSide] | None = None, side: DecodeSide | None = None) -> SiteChoice:
        cached = cached_tokens(request.num_prompt_tokens, view.cached_blocks(decode.worker_id, request.prefix_hashes),
                               decode.block_size)
        workers = view.prefill_workers(request.model)
        if decode.role is not WorkerRole.DECODE or not workers or self._rule.prefill_locally(
                request.num_prompt_tokens, cached):
            return SiteChoice(evaluate(request, view, decode, None, side), SiteReason.SHORT_PROMPT, 0.0)
        sides = [prefill_side(request, view, w) for w in workers]  # every prefill worker, not the ranked pool
        options = [evaluate(request, view, decode, p.worker, side, p) for p in sides]
        return SiteChoice(max(options, key=lambda p: p.slack(request)), SiteReason.REMOTE_CHEAPER, 0.0)


def cluster() -> list[SimWorkerSpec]:
    specs = [SimWorkerSpec("prefill-0", WorkerRole.PREFILL, CARD, max_batch=256)]
    return specs + [SimWorkerSpec(f"decode-{i}", WorkerRole.DECODE, CARD, max_batch=256) for i in range(3)]


def workload(rate: float, requests: int, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    now, trace = 0.0, []
    for i in range(requests):
        now += rng.expovariate(rate)
        doc = rng.random() < 0.3
        prompt = rng.randint(2048, 6144) if doc else rng.randint(64, 768)
        output = rng.randint(32, 128) if doc else rng.randint(32, 256)
        trace.append(Arrival(now, f"r{i}", prompt, output, extend_chain((), prompt // 16, seed * 10**6 + i),
                             Tier.ENTERPRISE))
    return trace


SITINGS: dict[str, type[PrefillSiting]] = {"cost": PrefillSiting, "threshold": ThresholdSiting}
SMOKE_RATES, SMOKE_REQUESTS = [16.0, 32.0], 80  # the rates where the two part ways, briefly


@dataclass(frozen=True)
class SitingRow:
    """One siting at one rate, averaged over the seeds."""

    rate: float
    siting: str
    attainment: float  # the share of requests that met the SLO
    remote_share: float  # of the requests served, the share prefilled on the prefill worker
    ttft_p90_ms: float
    tpot_p90_ms: float


def compare(rates: Sequence[float], requests: int, seeds: Sequence[int], slo: SLO) -> list[SitingRow]:
    rows = []
    for rate in rates:
        for name, siting in SITINGS.items():
            runs = [replay(workload(rate, requests, seed), cluster(), GoodputPolicy(siting=siting()),
                           slo, ReplayConfig(seed=seed)) for seed in seeds]
            served = [o for r in runs for o in r.outcomes if o.decode_worker_id is not None]
            rows.append(SitingRow(
                rate, name, statistics.fmean(r.goodput for r in runs),
                sum(o.prefill_worker_id is not None for o in served) / max(len(served), 1),
                statistics.fmean(r.percentile_ms("ttft_s", 90) or 0 for r in runs),
                statistics.fmean(r.percentile_ms("tpot_s", 90) or 0 for r in runs)))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="default 4 8 12 16; smoke 16 32")
    parser.add_argument("--requests", type=int, default=None, help="per rate and seed (default 400; smoke 80)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2; smoke 0")
    parser.add_argument("--ttft-ms", type=float, default=SLO_TARGET.ttft_ms)
    parser.add_argument("--tpot-ms", type=float, default=SLO_TARGET.tpot_ms)
    parser.add_argument("--smoke", action="store_true", help="CI: the defaults shrink to seconds")
    args = parser.parse_args(argv)
    rates = args.rates or (SMOKE_RATES if args.smoke else [4.0, 8.0, 12.0, 16.0])
    requests = args.requests or (SMOKE_REQUESTS if args.smoke else 400)
    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2])
    print(f"{'rate':>5} {'siting':>10} {'attainment':>11} {'remote':>7} {'TTFT p90':>9} {'TPOT p90':>9}")
    for row in compare(rates, requests, seeds, SLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)):
        print(f"{row.rate:>5g} {row.siting:>10} {row.attainment:>11.1%} {row.remote_share:>7.0%} "
              f"{row.ttft_p90_ms:>7.0f}ms {row.tpot_p90_ms:>7.1f}ms")


if __name__ == "__main__":
    main()
