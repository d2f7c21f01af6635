"""The read-only picture of the cluster a policy routes against.

A policy sees each live worker as a `WorkerLoad`: its last heartbeat plus the load the scheduler
itself has sent there since (which the heartbeat cannot show yet). Without that correction every
request arriving between two heartbeats would see the same "emptiest" worker and herd onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter

from scheduler.core.cost_model import CostModel
from scheduler.core.prefix_index import PrefixIndex
from scheduler.types import WorkerRole, WorkerSnapshot


@dataclass(frozen=True)
class WorkerLoad:
    snapshot: WorkerSnapshot
    queued_prefill_tokens: int  # prompt tokens waiting to be prefilled here, reported + routed since
    queued_prefill_requests: int  # the prompts those tokens belong to (mid-prefill ones included)
    decode_batch: int  # sequences that will be in the decode batch: running + waiting + routed since
    context_tokens: int  # their summed context length
    free_blocks: int  # reported free blocks minus blocks reserved by requests routed since
    # Tightest TPOT target (ms) among requests the scheduler placed here that have not finished;
    # a new request must not push the step time past it. None: no tracked request here.
    tightest_tpot_ms: float | None = None
    # Recent placements' prompts prefilled here: their predicted compute, seconds per second, and
    # prompts per second. What they take from a decoding batch's time depends on that batch's step
    # (`prefill_load.prefill_share`); the decode steps of everyone on the worker get the rest.
    prefill_work_rate: float = 0.0
    prefill_rate: float = 0.0
    # The same prompts' chunks per second (the engine's prefill slices), and what one costs the
    # decoding batch as the worker's mixed steps measured it (None until it has reported a few): when
    # known, the share is their product (`prefill_load.measured_share`), the rates above the prior.
    prefill_chunk_rate: float = 0.0
    folded_s_per_chunk: float | None = None
    folded_s_per_step: float | None = None  # a mixed step's mean excess over the batch's decode step
    # Requests placed here to decode per second, recently (the same window as the prefill rates): the
    # sequences that will join a newcomer's batch during its life (batch_forecast.life_batch).
    arrival_rate: float = 0.0
    # Seconds since the heartbeat behind `snapshot` arrived: the running sequences have made that much
    # progress since they reported how many tokens they may still generate.
    heartbeat_age_s: float = 0.0
    # Copied from the snapshot on construction (and by `replace`): a routing decision reads them a
    # few hundred times, and a field costs less than a property (docs/benchmarks.md, decision latency).
    worker_id: str = field(init=False, repr=False, compare=False)
    role: WorkerRole = field(init=False, repr=False, compare=False)
    block_size: int = field(init=False, repr=False, compare=False)
    # Decode batch slots; None when the worker does not say (treated as unlimited).
    max_num_seqs: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        snapshot = self.snapshot
        object.__setattr__(self, "worker_id", snapshot.worker_id)  # frozen: set once, here
        object.__setattr__(self, "role", snapshot.role)
        object.__setattr__(self, "block_size", snapshot.block_size)
        object.__setattr__(self, "max_num_seqs", snapshot.max_num_seqs or None)

    @property
    def slot_queue(self) -> float:
        """Sequences a newcomer would wait behind for a slot, per slot: 0 while a slot is free (and
        when slots are unknown), 1/S for the first in line on S full slots, 1 a whole batch ahead."""
        slots = self.max_num_seqs
        if slots is None or self.decode_batch < slots:
            return 0.0
        return (self.decode_batch - slots + 1) / slots

    def idle(self) -> WorkerLoad:
        """The same worker with nothing running: what it could do for a request at best."""
        return replace(
            self,
            queued_prefill_tokens=0,
            queued_prefill_requests=0,
            decode_batch=0,
            context_tokens=0,
            free_blocks=self.snapshot.total_blocks,
            tightest_tpot_ms=None,
            prefill_work_rate=0.0,
            prefill_rate=0.0,
            prefill_chunk_rate=0.0,
            arrival_rate=0.0,
        )


class ClusterView:
    """Live workers, their cost models, the prefix index and conversation stickiness.

    Policies must treat it as read-only; it is rebuilt for every routing call, so it never goes
    stale inside one decision and never needs locking.
    """

    def __init__(
        self,
        loads: Sequence[WorkerLoad],
        costs: Mapping[str, CostModel],
        prefix_index: PrefixIndex,
        conversations: Mapping[str, str],
    ) -> None:
        self._loads = sorted(loads, key=_WORKER_ID)  # sorted: decisions are reproducible
        self._costs = costs
        self._prefix_index = prefix_index
        self._conversations = conversations
        # Prefix matches per prompt (`prefix_matches`), keyed by the hash sequence's identity (hashing
        # a long tuple costs as much as the match); the entry keeps the sequence itself, so its id
        # can't be reused while the entry exists.
        self._matches: dict[int, tuple[Sequence[int], dict[str, int]]] = {}
        self._by_model: dict[tuple[bool, str], list[WorkerLoad]] = {}  # (decode?, model) -> workers

    def decode_workers(self, model: str = "") -> list[WorkerLoad]:
        workers = self._by_model.get((True, model))
        if workers is None:
            workers = self._by_model[True, model] = [w for w in self._serving(model) if w.role.can_decode]
        return list(workers)

    def prefill_workers(self, model: str = "") -> list[WorkerLoad]:
        """Dedicated prefill workers only; BOTH workers prefill their own requests locally."""
        workers = self._by_model.get((False, model))
        if workers is None:
            workers = self._by_model[False, model] = [
                w for w in self._serving(model) if w.role is WorkerRole.PREFILL
            ]
        return list(workers)

    def _serving(self, model: str) -> list[WorkerLoad]:
        """The workers serving `model` (every worker when it is empty)."""
        return self._loads if not model else [w for w in self._loads if w.snapshot.model == model]

    def cost(self, worker_id: str) -> CostModel:
        return self._costs[worker_id]

    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        return self.prefix_matches(hashes).get(worker_id, 0)

    def prefix_matches(self, hashes: Sequence[int]) -> Mapping[str, int]:
        """Leading blocks of a prompt (its chained `hashes`) cached, per worker holding at least the
        first; a worker not listed holds none. Computed once per prompt and view: policies ask for
        many workers' matches while comparing candidates."""
        entry = self._matches.get(id(hashes))
        if entry is None or entry[0] is not hashes:
            entry = self._matches[id(hashes)] = (hashes, self._prefix_index.match_all(hashes))
        return entry[1]

    def conversation_worker(self, conversation_id: str | None) -> str | None:
        """The decode worker that served the conversation's previous turn, if known."""
        if conversation_id is None:
            return None
        return self._conversations.get(conversation_id)


_WORKER_ID = attrgetter("worker_id")
