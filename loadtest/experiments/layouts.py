"""Cluster layouts of the DistServe experiment: how many prefill, decode and co-located workers.

A layout is named the way the literature writes it: `1p3d` is one prefill and three decode workers,
`c4` four co-located (`both`) workers. The 2-GPU names of the first experiment stay valid:
`disagg` = `1p1d`, `colocated` = `c2`. Each worker takes `tp` consecutive GPUs, prefill workers first:
`2p2d` at TP=1 puts prefill on GPUs 0 and 1 and decode on 2 and 3.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ALIASES = {"disagg": "1p1d", "colocated": "c2"}
_DISAGG = re.compile(r"(\d+)p(\d+)d")
_COLOCATED = re.compile(r"c(\d+)")


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    role: str  # prefill | decode | both
    gpus: tuple[int, ...]  # physical indices, one per TP rank; ignored on CPU


@dataclass(frozen=True)
class Layout:
    name: str  # as given on the command line (the run files and the summary use it)
    prefill: int
    decode: int
    both: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.both

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    def gpus(self, tp: int) -> int:
        return self.workers * tp

    def worker_plans(self, tp: int = 1) -> tuple[WorkerPlan, ...]:
        roles = ["prefill"] * self.prefill + ["decode"] * self.decode + ["both"] * self.both
        plans = []
        for i, role in enumerate(roles):
            gpus = tuple(range(i * tp, (i + 1) * tp))
            plans.append(WorkerPlan(f"{role}-gpu{'-'.join(map(str, gpus))}", role, gpus))
        return tuple(plans)


def parse_layout(name: str) -> Layout:
    """`c<N>`, `<X>p<Y>d`, or an alias; ValueError with the valid forms otherwise."""
    canonical = ALIASES.get(name, name).lower()
    if m := _DISAGG.fullmatch(canonical):
        prefill, decode = int(m[1]), int(m[2])
        if prefill >= 1 and decode >= 1:
            return Layout(name, prefill, decode, 0)
    elif (m := _COLOCATED.fullmatch(canonical)) and int(m[1]) >= 1:
        return Layout(name, 0, 0, int(m[1]))
    raise ValueError(f"unknown layout {name!r}: use c<N> (N co-located workers), <X>p<Y>d (X prefill + Y decode "
                     f"workers, X, Y >= 1) or one of {', '.join(ALIASES)}")


def layout_gpus(name: str, tp: int = 1) -> int:
    """GPUs a layout name uses (the report divides goodput by this)."""
    return parse_layout(name).gpus(tp)
