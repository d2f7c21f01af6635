"""Per-fleet load signals for autoscaling: what a horizontal autoscaler needs to grow or shrink
the prefill and decode fleets separately (the Prometheus names are in docs/operations.md).

A fleet is every live worker of one role. Computed from the loads the policy routes against
(last heartbeat plus what was routed since), so a burst shows before the next heartbeat does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.core.cluster_view import WorkerLoad
from scheduler.core.cost_model import CostModel
from scheduler.types import WorkerRole


@dataclass(frozen=True)
class FleetSignal:
    role: WorkerRole
    workers: int
    queue_s: float  # mean predicted wait before a new prompt starts prefilling (drain of the backlog)
    kv_usage: float  # fraction of the fleet's KV blocks in use or reserved, 0..1
    prefill_backlog_tokens: int  # prompt tokens queued or being prefilled across the fleet
    decode_seqs: int  # sequences in (or waiting for) the fleet's decode batches


def fleet_signals(loads: Iterable[WorkerLoad], costs: Mapping[str, CostModel]) -> list[FleetSignal]:
    """One signal per role, every role included (an empty fleet reads zeros, so a gauge drops to 0)."""
    by_role: dict[WorkerRole, list[WorkerLoad]] = {role: [] for role in WorkerRole}
    for load in loads:
        by_role[load.role].append(load)
    return [_signal(role, fleet, costs) for role, fleet in by_role.items()]


def _signal(role: WorkerRole, fleet: list[WorkerLoad], costs: Mapping[str, CostModel]) -> FleetSignal:
    if not fleet:
        return FleetSignal(role, 0, 0.0, 0.0, 0, 0)
    waits = [
        costs[w.worker_id].prefill_backlog_s(w.queued_prefill_tokens, w.queued_prefill_requests)
        for w in fleet
        if w.worker_id in costs
    ]
    total = sum(w.snapshot.total_blocks for w in fleet)
    free = sum(w.free_blocks for w in fleet)
    return FleetSignal(
        role=role,
        workers=len(fleet),
        queue_s=sum(waits) / len(waits) if waits else 0.0,
        kv_usage=1.0 - free / total if total else 0.0,
        prefill_backlog_tokens=sum(w.queued_prefill_tokens for w in fleet),
        decode_seqs=sum(w.decode_batch for w in fleet) if role.can_decode else 0,
    )
