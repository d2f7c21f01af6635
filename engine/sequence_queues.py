"""`SequenceQueues`: every unfinished sequence the batcher holds, and the queue its status puts it in.

WAITING / PREEMPTED sequences wait in admission order (engine/waiting_queue.py); RUNNING ones are kept
oldest first, so preemption victims come from the end; WAITING_FOR_REMOTE_KV ones hold the blocks a
remote prefill writes and are never scheduled; LOADING_KV ones hold the blocks a lower KV tier copies
into (engine/tier_load_queue.py). The moves between queues live here, with the block frees and
registrations they imply, so that the request calls (engine/batcher.py) and the step's planning
(engine/step_planner.py) share one account of where each sequence is.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from engine.block_manager import BlockManager
from engine.kv_tiers.types import KVLoader
from engine.sequence import Sequence, SequenceStatus
from engine.tier_load_queue import TierLoadQueue
from engine.waiting_queue import WaitingQueue


def _arrival(seq: Sequence) -> int:
    """Sort key of the running list: oldest first, so preemption victims come from the end."""
    return seq.arrival_order


class SequenceQueues:
    """Not thread-safe."""

    def __init__(self, block_manager: BlockManager, loader: KVLoader | None) -> None:
        self.block_manager = block_manager
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, whatever its state
        self.waiting = WaitingQueue()  # WAITING / PREEMPTED, admission order
        self.running: list[Sequence] = []  # RUNNING, sorted by arrival_order (oldest first)
        self.remote: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV: hold blocks, not scheduled
        self.loading = TierLoadQueue(loader)  # LOADING_KV: hold blocks a lower tier copies into
        self.num_preemptions = 0  # since start, for metrics
        self._next_arrival = 0  # arrival_order of the next tracked sequence

    @property
    def num_holding_slots(self) -> int:
        """Sequences that take one of `max_num_seqs`' slots: running, waiting for remote KV, loading."""
        return len(self.running) + len(self.remote) + len(self.loading)

    def prefilling(self) -> Iterator[Sequence]:
        """Sequences with prompt (or recompute) tokens still to prefill: waiting, or running part-way
        through their chunks."""
        yield from self.waiting
        yield from (seq for seq in self.running if seq.num_pending_tokens > 1)

    def track(self, seq: Sequence, status: SequenceStatus) -> None:
        """Hold a new sequence in `status`, its arrival order the next one; the caller queues it."""
        seq.status, seq.arrival_order = status, self._next_arrival
        self._next_arrival += 1
        self.seqs[seq.request_id] = seq

    def run(self, seq: Sequence) -> None:
        """Join the running list, in arrival order."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_arrival)

    def remove(self, request_id: str) -> Sequence | None:
        """Forget a sequence in any state, freeing every block it holds; None when it is not held."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[request_id]
        elif seq.status is SequenceStatus.LOADING_KV:
            self.loading.cancel(request_id)  # returns once no copy writes into its blocks
        else:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        return seq

    def preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free the blocks, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.push_preempted(seq)

    def finish_loads(self) -> None:
        """Move sequences whose tier load finished to the running list, the landed tokens computed (a
        failed block and everything after it is simply prefilled: same output)."""
        for seq, loaded in self.loading.finished():
            seq.num_computed_tokens += loaded
            if seq.num_preemptions == 0:
                seq.num_cached_tokens += loaded
                seq.num_tier_loaded_tokens = loaded
            self.block_manager.mark_computed(seq.block_ids, seq.all_token_ids, seq.num_computed_tokens)
            self.run(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
        seq.block_ids = []
