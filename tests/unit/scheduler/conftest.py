"""Builders for scheduler-core tests: snapshots, requests and cluster views with chosen loads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.cost_model import CostModel, WorkerProfile
from scheduler.core.prefix_index import PrefixIndex
from scheduler.types import SLO, KVEvent, KVEventKind, RequestSummary, Tier, WorkerRole, WorkerSnapshot

FAST = WorkerProfile(
    prefill_fixed_s=0.005,
    prefill_per_token_s=5e-5,
    prefill_per_token_sq_s=0.0,
    decode_fixed_s=0.01,
    decode_per_seq_s=1e-4,
    decode_per_context_token_s=0.0,
)
SLOW = replace(
    FAST,
    prefill_fixed_s=0.02,
    prefill_per_token_s=2e-4,
    decode_fixed_s=0.04,
    decode_per_seq_s=4e-4,
)


def snapshot(worker_id: str, role: WorkerRole = WorkerRole.DECODE, **overrides: Any) -> WorkerSnapshot:
    fields: dict[str, Any] = {
        "worker_id": worker_id,
        "role": role,
        "model": "m",
        "address": f"10.0.0.1:{abs(hash(worker_id)) % 1000 + 5000}",
        "queue_depth": 0,
        "running_seqs": 0,
        "free_blocks": 1000,
        "total_blocks": 1000,
        "block_size": 16,
        "inflight_prefill_tokens": 0,
        "heartbeat_at": 0.0,
    }
    fields.update(overrides)
    return WorkerSnapshot(**fields)


def request(
    request_id: str = "r1",
    prompt: int = 512,
    tier: Tier = Tier.FREE,
    slo: SLO | None = None,
    max_tokens: int = 64,
    hashes: Sequence[int] | None = None,
    conversation_id: str | None = None,
) -> RequestSummary:
    return RequestSummary(
        request_id=request_id,
        num_prompt_tokens=prompt,
        prefix_hashes=tuple(range(1, prompt // 16 + 1)) if hashes is None else tuple(hashes),
        tier=tier,
        slo=slo or SLO(ttft_ms=2000, tpot_ms=100),
        max_tokens=max_tokens,
        conversation_id=conversation_id,
    )


def load(
    worker_id: str, role: WorkerRole = WorkerRole.DECODE, batch: int = 0, **overrides: Any
) -> WorkerLoad:
    """A worker as a policy sees it, with `batch` sequences and nothing else going on."""
    snap = snapshot(worker_id, role, running_seqs=batch)
    fields: dict[str, Any] = {
        "snapshot": snap,
        "queued_prefill_tokens": 0,
        "queued_prefill_requests": 0,
        "decode_batch": batch,
        "context_tokens": 0,
        "free_blocks": snap.free_blocks,
    }
    fields.update(overrides)
    return WorkerLoad(**fields)


def view(
    loads: Sequence[WorkerLoad],
    profiles: Mapping[str, WorkerProfile] | None = None,
    cached: Mapping[str, Sequence[int]] | None = None,
    conversations: Mapping[str, str] | None = None,
) -> ClusterView:
    """A view over `loads`; `cached` maps worker id -> block hashes it holds."""
    index = PrefixIndex()
    for worker_id, hashes in (cached or {}).items():
        index.apply(worker_id, [KVEvent(KVEventKind.STORED, h) for h in hashes])
    costs = {w.worker_id: CostModel((profiles or {}).get(w.worker_id, FAST)) for w in loads}
    return ClusterView(loads, costs, index, dict(conversations or {}))


@pytest.fixture
def make_snapshot() -> Callable[..., WorkerSnapshot]:
    return snapshot


@pytest.fixture
def make_request() -> Callable[..., RequestSummary]:
    return request


@pytest.fixture
def make_load() -> Callable[..., WorkerLoad]:
    return load


@pytest.fixture
def make_view() -> Callable[..., ClusterView]:
    return view


@pytest.fixture
def fast_profile() -> WorkerProfile:
    return FAST


@pytest.fixture
def slow_profile() -> WorkerProfile:
    """About 4x slower than `fast_profile` at both prefill and decode."""
    return SLOW
