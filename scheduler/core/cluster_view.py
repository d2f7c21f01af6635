"""The read-only picture of the cluster a policy routes against.

A policy sees each live worker as a `WorkerLoad`: its last heartbeat plus the load the scheduler
itself has sent there since (which the heartbeat cannot show yet). Without that correction every
request arriving between two heartbeats would see the same "emptiest" worker and herd onto it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

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
    # Fraction of the engine's time recent placements' prefills take here (prefill_load.py): the
    # decode steps of everyone on the worker get the rest.
    prefill_share: float = 0.0
    # Seconds since the heartbeat behind `snapshot` arrived: the running sequences have made that much
    # progress since they reported how many tokens they may still generate.
    heartbeat_age_s: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.snapshot.worker_id

    @property
    def role(self) -> WorkerRole:
        return self.snapshot.role

    @property
    def block_size(self) -> int:
        return self.snapshot.block_size

    @property
    def max_num_seqs(self) -> int | None:
        """Decode batch slots; None when the worker does not say (treated as unlimited)."""
        return self.snapshot.max_num_seqs or None

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
            prefill_share=0.0,
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
        self._loads = sorted(loads, key=lambda w: w.worker_id)  # sorted: decisions are reproducible
        self._costs = costs
        self._prefix_index = prefix_index
        self._conversations = conversations
        # Policies ask for the same (worker, prompt) match many times while comparing candidates.
        # Keyed by the hash sequence's identity (hashing a long tuple costs as much as the match);
        # the entry keeps the sequence itself, so its id can't be reused while the entry exists.
        self._matches: dict[tuple[str, int], tuple[Sequence[int], int]] = {}
        self._by_model: dict[tuple[bool, str], list[WorkerLoad]] = {}  # (decode?, model) -> workers

    def decode_workers(self, model: str = "") -> list[WorkerLoad]:
        workers = self._by_model.get((True, model))
        if workers is None:
            workers = self._by_model[True, model] = [
                w for w in self._loads if w.role.can_decode and _serves(w, model)
            ]
        return list(workers)

    def prefill_workers(self, model: str = "") -> list[WorkerLoad]:
        """Dedicated prefill workers only; BOTH workers prefill their own requests locally."""
        workers = self._by_model.get((False, model))
        if workers is None:
            workers = self._by_model[False, model] = [
                w for w in self._loads if w.role is WorkerRole.PREFILL and _serves(w, model)
            ]
        return list(workers)

    def cost(self, worker_id: str) -> CostModel:
        return self._costs[worker_id]

    def cached_blocks(self, worker_id: str, hashes: Sequence[int]) -> int:
        key = (worker_id, id(hashes))
        entry = self._matches.get(key)
        if entry is None or entry[0] is not hashes:
            entry = self._matches[key] = (hashes, self._prefix_index.match(worker_id, hashes))
        return entry[1]

    def holders(self, block_hash: int) -> frozenset[str]:
        """Workers holding this block (a worker missing a prompt's first block holds none of it)."""
        return self._prefix_index.holders(block_hash)

    def conversation_worker(self, conversation_id: str | None) -> str | None:
        """The decode worker that served the conversation's previous turn, if known."""
        if conversation_id is None:
            return None
        return self._conversations.get(conversation_id)


def _serves(worker: WorkerLoad, model: str) -> bool:
    return not model or worker.snapshot.model == model
