"""A fixed heterogeneous scenario for comparing policies (the replay CLI and tests use it).

Two card generations share one cluster: the fast prefill and decode workers are ~2.5x quicker
than the slow ones, as an H100 is next to an A10-class card. Tiers carry different SLOs, so a
slow decode worker can still serve free-tier traffic within target but not enterprise traffic.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.trace import Arrival, WorkloadSpec, make_trace
from scheduler.sim.worker import SimWorkerSpec
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
