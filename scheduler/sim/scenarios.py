"""A fixed heterogeneous scenario for comparing policies (the replay CLI and tests use it).

Two card generations share one cluster: the fast prefill and decode workers are ~2.5x quicker
than the slow ones, as an H100 is next to an A10-class card. Tiers carry different SLOs, so a
slow decode worker can still serve free-tier traffic within target but not enterprise traffic.
"""

from __future__ import annotations

import random
from dataclasses import replace

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, WorkloadSpec, extend_chain, make_trace
from scheduler.types import SLO, Tier, WorkerRole

FAST = WorkerProfile(
    prefill_fixed_s=0.008,
    prefill_per_token_s=6e-5,
    prefill_per_token_sq_s=4e-9,
    decode_fixed_s=0.012,
    decode_per_seq_s=1.5e-4,
    decode_per_context_token_s=4e-8,
    transfer_fixed_s=0.002,
    transfer_per_token_s=1e-6,
)
SLOW_FACTOR = 2.5


def slower(profile: WorkerProfile, factor: float) -> WorkerProfile:
    """The same model on a card `factor` times slower at compute and memory (the link unchanged)."""
    return replace(
        profile,
        prefill_fixed_s=profile.prefill_fixed_s * factor,
        prefill_per_token_s=profile.prefill_per_token_s * factor,
        prefill_per_token_sq_s=profile.prefill_per_token_sq_s * factor,
        prefill_floor_s=profile.prefill_floor_s * factor,
        decode_fixed_s=profile.decode_fixed_s * factor,
        decode_per_seq_s=profile.decode_per_seq_s * factor,
        decode_per_context_token_s=profile.decode_per_context_token_s * factor,
    )


def heterogeneous_cluster() -> list[SimWorkerSpec]:
    slow = slower(FAST, SLOW_FACTOR)
    return [
        SimWorkerSpec("prefill-fast", WorkerRole.PREFILL, FAST),
        SimWorkerSpec("prefill-slow", WorkerRole.PREFILL, slow),
        SimWorkerSpec("decode-fast-0", WorkerRole.DECODE, FAST),
        SimWorkerSpec("decode-fast-1", WorkerRole.DECODE, FAST),
        SimWorkerSpec("decode-slow", WorkerRole.DECODE, slow),
    ]


def tier_slos() -> dict[Tier, SLO]:
    return {
        Tier.ENTERPRISE: SLO(ttft_ms=1000, tpot_ms=50),
        Tier.PLUS: SLO(ttft_ms=1500, tpot_ms=75),
        Tier.FREE: SLO(ttft_ms=3000, tpot_ms=100),
    }


def heterogeneous_workload(
    rate_per_s: float = 20.0, num_requests: int = 1000, seed: int = 0
) -> list[Arrival]:
    return make_trace(WorkloadSpec(num_requests=num_requests, rate_per_s=rate_per_s, seed=seed))


# ---- the CPU experiment's cluster (lab/experiments/policy_compare.py) -----------------------

# Step times of SmolLM2-135M on one CPU core, as fitted to the real workers' samples
# (docs/benchmarks.md, scheduler policies: prefill 93 ms + 2.0 ms/token, decode 31 ms + 48 ms/seq).
CPU = WorkerProfile(
    prefill_fixed_s=0.09,
    prefill_per_token_s=2e-3,
    prefill_per_token_sq_s=0.0,
    decode_fixed_s=0.03,
    decode_per_seq_s=0.048,
    decode_per_context_token_s=1e-6,
    transfer_fixed_s=0.0,
    transfer_per_token_s=0.0,
)


def cpu_cluster() -> list[SimWorkerSpec]:
    """Two `both` workers, the same CPU, heterogeneous by batch slots only (8 vs 1), 384 blocks each."""
    return [
        SimWorkerSpec("worker-a", WorkerRole.BOTH, CPU, total_blocks=384, max_batch=8),
        SimWorkerSpec("worker-b", WorkerRole.BOTH, CPU, total_blocks=384, max_batch=1),
    ]


def cpu_slos() -> dict[Tier, SLO]:
    enterprise = SLO(ttft_ms=2500, tpot_ms=250)
    return {Tier.ENTERPRISE: enterprise, Tier.PLUS: enterprise, Tier.FREE: SLO(ttft_ms=6000, tpot_ms=500)}


def random_workload(
    tier: Tier,
    rate_per_s: float,
    num_requests: int,
    seed: int,
    prompt_tokens: tuple[int, int] = (32, 96),
    output_tokens: tuple[int, int] = (16, 24),
) -> list[Arrival]:
    """Single-turn requests of uniform random lengths, Poisson arrivals, one tier, no shared prefix
    (`baton bench --dataset random`)."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    now = 0.0
    for index in range(num_requests):
        now += rng.expovariate(rate_per_s)
        prompt = rng.randint(*prompt_tokens)
        label = seed * 1_000_000 + index
        hashes = extend_chain((), prompt // 16, label=label)
        request_id = f"{tier.value}-{seed}-{index:05d}"
        arrivals.append(Arrival(now, request_id, prompt, rng.randint(*output_tokens), hashes, tier))
    return arrivals


def merge(*traces: list[Arrival]) -> list[Arrival]:
    """Several traces sent at once (e.g. one `baton bench` per tier), in arrival order."""
    return sorted((a for trace in traces for a in trace), key=lambda a: a.time_s)
