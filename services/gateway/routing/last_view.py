"""The gateway's own picture of the workers, for routing without the scheduler (router_client.py says
when): the static workers it was configured with, or the scheduler's last list, plus what this
gateway has sent to each since. `LastView.pick` takes the least-loaded worker that serves the model.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rpcgen.baton.v1 import scheduler_pb2 as pb
from scheduler.types import RequestSummary, WorkerRole

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticWorkers:
    decode: tuple[str, ...]  # host:port of decode (or both-role) workers
    prefill: tuple[str, ...] = ()
    model: str = ""  # the model they serve; empty: any

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("static routing needs at least one decode worker address")


@dataclass(frozen=True)
class KnownWorker:
    address: str
    role: WorkerRole
    model: str = ""  # empty: unknown (static workers), serves any model
    load: int = 0  # running + queued sequences at the last view


class LastView:
    """Workers as last seen, plus what this client sent to each since; not thread-safe (one loop)."""

    def __init__(self, workers: Sequence[KnownWorker] = ()) -> None:
        self.workers: tuple[KnownWorker, ...] = tuple(workers)
        self._sent: Counter[str] = Counter()  # address -> requests routed here since the view
        self._placed: dict[str, tuple[str, ...]] = {}  # request id -> addresses it was charged to
        self._turn = itertools.count()

    def replace(self, workers: Sequence[KnownWorker]) -> None:
        # The new loads already include what was sent before: start counting afresh.
        self.workers = tuple(workers)
        self._sent.clear()
        self._placed.clear()

    def pick(self, summary: RequestSummary, min_remote_prefill_tokens: int,
             avoid: frozenset[str] = frozenset()) -> tuple[str, str | None] | None:
        """(decode address, prefill address or None) or None when no worker (but those in `avoid`)
        serves the model."""
        serving = [w for w in self.workers if (not summary.model or w.model in ("", summary.model))
                   and w.address not in avoid]
        decode = self._least_loaded([w for w in serving if w.role.can_decode])
        if decode is None:
            return None
        prefill = None
        if summary.num_prompt_tokens >= min_remote_prefill_tokens:
            prefill = self._least_loaded([w for w in serving if w.role is WorkerRole.PREFILL])
        chosen = (decode,) if prefill is None else (decode, prefill)
        self._sent.update(chosen)
        self._placed[summary.request_id] = chosen
        return decode, prefill

    def done(self, request_id: str) -> None:
        self._sent.subtract(self._placed.pop(request_id, ()))

    def _least_loaded(self, workers: list[KnownWorker]) -> str | None:
        if not workers:
            return None
        # Rotate the start so equal loads take turns (round-robin when nothing else differs).
        start = next(self._turn) % len(workers)
        rotated = workers[start:] + workers[:start]
        return min(rotated, key=lambda w: w.load + self._sent[w.address]).address


def static_view(static: StaticWorkers | None) -> LastView:
    if static is None:
        return LastView()
    workers = [KnownWorker(a, WorkerRole.DECODE, static.model) for a in static.decode]
    workers += [KnownWorker(a, WorkerRole.PREFILL, static.model) for a in static.prefill]
    return LastView(workers)


def known_worker(worker: pb.LiveWorker) -> KnownWorker | None:
    status = worker.status
    if status.role not in {r.value for r in WorkerRole}:
        log.warning("ignoring listed worker %s with unknown role %r", status.worker_id, status.role)
        return None
    return KnownWorker(
        address=worker.address,
        role=WorkerRole(status.role),
        model=status.model,
        load=status.running_seqs + status.queue_depth,
    )
