"""The workers of a layout: one `WorkerPlan` per `baton worker` process the cluster builder starts.

A `WorkerFleet` turns the planner's `Layout` (scheduler/planner.py: how many prefill, decode or
co-located workers, at which TP x PP shape) into plans: prefill workers first, each decode worker
naming every prefill worker of its fleet as a peer (the KV moves rank by rank), each worker on the
consecutive GPUs its shape takes. Callers that need more than a layout says (one worker's own flags,
a reference worker beside a disaggregated pair) build or edit `WorkerPlan`s themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from scheduler.planner import Layout
from scheduler.types import WorkerRole


@dataclass(frozen=True)
class WorkerPlan:
    """One worker process: what `baton worker` gets beyond its address, ports, peers and scheduler."""

    name: str  # the child's name (and log file); its scheduler id too when `worker_id`
    role: WorkerRole
    args: tuple[str, ...] = ()  # its other `baton worker` flags (model, engine, threads, KV pool, ...)
    env: Mapping[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES
    prefill_peers: tuple[str, ...] = ()  # names of the prefill plans this decode worker hands off from
    worker_id: bool = False  # pass `name` as `--worker-id`; False: the worker's default id
    model: str = ""  # the served model's name ("": the default); the gateway's static route is the first's
    gpus: tuple[int, ...] = ()  # the GPUs its shape takes (one per rank), whether pinned or not


@dataclass(frozen=True)
class RoleArgs:
    """`baton worker` flags by role; `common` goes to every worker, first."""

    common: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    both: tuple[str, ...] = ()

    def of(self, role: WorkerRole) -> tuple[str, ...]:
        by_role = {WorkerRole.PREFILL: self.prefill, WorkerRole.DECODE: self.decode, WorkerRole.BOTH: self.both}
        return self.common + by_role[role]


class WorkerNaming(enum.Enum):
    ROLE = "role"  # <prefix><role> (`worker-decode`, as `baton serve` names them), -<i> from the second on
    GPUS = "gpus"  # <role>-gpu<first>-...-<last>: where a GPU experiment placed it


@dataclass(frozen=True)
class WorkerFleet:
    layout: Layout
    args: RoleArgs = RoleArgs()
    naming: WorkerNaming = WorkerNaming.ROLE
    name_prefix: str = "worker-"  # WorkerNaming.ROLE only
    pin_gpus: bool = False  # CUDA_VISIBLE_DEVICES = each worker's GPUs (False: inherit, e.g. on CPU)
    worker_ids: bool = False  # each worker's name is its `--worker-id`
    model: str = ""  # what WorkerPlan.model says

    def plans(self) -> tuple[WorkerPlan, ...]:
        roles = self._roles()
        plans: list[WorkerPlan] = []
        first_gpu = 0
        for role in roles:
            shape = self.layout.decode_shape if role is not WorkerRole.PREFILL else self.layout.prefill_shape
            gpus = tuple(range(first_gpu, first_gpu + shape.gpus))
            first_gpu += shape.gpus
            index = sum(1 for p in plans if p.role is role)
            env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if self.pin_gpus else {}
            plans.append(WorkerPlan(self._name(role, index, gpus), role, self.args.of(role), env,
                                    worker_id=self.worker_ids, model=self.model, gpus=gpus))
        prefill = tuple(p.name for p in plans if p.role is WorkerRole.PREFILL)
        return tuple(_with_peers(p, prefill) for p in plans)

    def _roles(self) -> list[WorkerRole]:
        if self.layout.colocated:
            return [WorkerRole.BOTH] * self.layout.decode_workers
        return [WorkerRole.PREFILL] * self.layout.prefill_workers + [WorkerRole.DECODE] * self.layout.decode_workers

    def _name(self, role: WorkerRole, index: int, gpus: tuple[int, ...]) -> str:
        if self.naming is WorkerNaming.GPUS:
            return f"{role}-gpu{'-'.join(map(str, gpus))}"
        return f"{self.name_prefix}{role}" + (f"-{index}" if index else "")


def _with_peers(plan: WorkerPlan, prefill: tuple[str, ...]) -> WorkerPlan:
    if plan.role is not WorkerRole.DECODE:
        return plan
    return replace(plan, prefill_peers=prefill)
