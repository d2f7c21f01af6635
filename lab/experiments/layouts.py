"""Cluster layouts of the DistServe experiment: how many prefill, decode and co-located workers.

A layout is named the way the literature writes it: `1p3d` is one prefill and three decode workers,
`c4` four co-located (`both`) workers. The 2-GPU names of the first experiment stay valid:
`disagg` = `1p1d`, `colocated` = `c2`. Each worker takes `tp` consecutive GPUs, prefill workers first:
`2p2d` at TP=1 puts prefill on GPUs 0 and 1 and decode on 2 and 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler.planner import Layout
from services.launcher.fleet import RoleArgs, WorkerFleet, WorkerNaming, WorkerPlan

ALIASES = {"disagg": "1p1d", "colocated": "c2"}
_DISAGG = re.compile(r"(\d+)p(\d+)d")
_COLOCATED = re.compile(r"c(\d+)")


@dataclass(frozen=True)
class NamedLayout:
    """The planner's `Layout` under the name it was given on the command line (the run files and the summary
    use that name). Every worker of an experiment runs at one TP size, passed where GPUs are counted."""

    name: str
    layout: Layout

    @property
    def disaggregated(self) -> bool:
        return not self.layout.colocated

    def gpus(self, tp: int) -> int:
        return (self.layout.prefill_workers + self.layout.decode_workers) * tp

    def worker_fleet(self, tp: int = 1, args: RoleArgs | None = None, pin_gpus: bool = False) -> WorkerFleet:
        """Its workers at `tp` ranks each, named by their GPUs (`prefill-gpu0`), each worker's id its name."""
        layout = Layout(self.layout.prefill_workers, self.layout.decode_workers, prefill_tp=tp, decode_tp=tp)
        return WorkerFleet(layout, args or RoleArgs(), WorkerNaming.GPUS, pin_gpus=pin_gpus, worker_ids=True)

    def worker_plans(self, tp: int = 1) -> tuple[WorkerPlan, ...]:
        return self.worker_fleet(tp).plans()


def parse_layout(name: str) -> NamedLayout:
    """`c<N>`, `<X>p<Y>d`, or an alias; ValueError with the valid forms otherwise."""
    canonical = ALIASES.get(name, name).lower()
    if m := _DISAGG.fullmatch(canonical):
        prefill, decode = int(m[1]), int(m[2])
        if prefill >= 1 and decode >= 1:
            return NamedLayout(name, Layout(prefill, decode))
    elif (m := _COLOCATED.fullmatch(canonical)) and int(m[1]) >= 1:
        return NamedLayout(name, Layout(0, int(m[1])))
    raise ValueError(f"unknown layout {name!r}: use c<N> (N co-located workers), <X>p<Y>d (X prefill + Y decode "
                     f"workers, X, Y >= 1) or one of {', '.join(ALIASES)}")


def layout_gpus(name: str, tp: int = 1) -> int:
    """GPUs a layout name uses (the report divides goodput by this)."""
    return parse_layout(name).gpus(tp)
