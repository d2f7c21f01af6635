"""The batcher's plans in flight: scheduled, not yet postprocessed, oldest first.

Under an overlapped pipeline (engine/parallel/pipeline_rounds.py) up to one plan per stage is in
flight; otherwise at most one, between `schedule()` and `postprocess()`. A sequence is in at most one
of them (the batcher skips in-flight sequences when it plans), so membership is by identity: a new
sequence that reuses an aborted one's request id is not held back by the old plan.

After a failed step the engine drops every plan (`clear`): their sequences are planned again. Plans
still in the pipeline's later stages then leave it in later rounds; `discard_dropped` knows them (the
last `depth` dropped), so the engine records nothing of them and no token twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.batch import BatchPlan
from engine.errors import EngineError
from engine.sequence import Sequence


@dataclass(frozen=True)
class _Entry:
    plan: BatchPlan
    seqs: dict[str, Sequence]


class InFlightPlans:
    def __init__(self, depth: int = 1) -> None:
        self._plans: deque[_Entry] = deque()
        self._dropped: deque[BatchPlan] = deque(maxlen=depth)  # at most depth - 1 can still leave

    def __len__(self) -> int:
        return len(self._plans)

    def add(self, plan: BatchPlan, seqs: dict[str, Sequence]) -> None:
        self._plans.append(_Entry(plan, seqs))

    def pop_oldest(self, plan: BatchPlan) -> dict[str, Sequence]:
        """The sequences `plan` ran, as scheduled; raises EngineError unless it is the oldest in flight
        (plans leave the pipeline in the order they entered it)."""
        if not self._plans or self._plans[0].plan is not plan:
            raise EngineError("postprocess of a plan that is not the oldest in flight")
        return self._plans.popleft().seqs

    def discard_dropped(self, plan: BatchPlan) -> bool:
        """Whether `plan` was dropped (`clear`); it is forgotten now that it left the pipeline."""
        for i, dropped in enumerate(self._dropped):
            if dropped is plan:
                del self._dropped[i]
                return True
        return False

    def holds(self, seq: Sequence) -> bool:
        return any(entry.seqs.get(seq.request_id) is seq for entry in self._plans)

    def request_ids(self) -> list[tuple[str, ...]]:
        """The request ids of each plan, oldest plan first."""
        return [tuple(entry.seqs) for entry in self._plans]

    def clear(self) -> None:
        """Drop every plan (module docstring)."""
        self._dropped.extend(entry.plan for entry in self._plans)
        self._plans.clear()
