"""`StepPlanner`: which tokens of which sequences the next step runs (the batcher's `schedule()`).

A step's plan, under a token budget of `max_num_batched_tokens` and at most `max_num_seqs` chunks:
1. decodes (running sequences with one pending token), oldest first; a decode that needs a new block
   when the pool is empty preempts the newest running sequence (possibly itself) by recompute;
2. chunks of running sequences still prefilling, oldest first, at most `max_prefill_chunk` each;
3. admission of waiting sequences, preempted ones first, then by `sampling.priority` (lower first, FIFO
   within one priority; strict, so a stream of high-priority work can hold lower work back), each only
   when blocks for all its tokens plus one generated token are available; skipped in a step that
   preempted, so a preempted sequence never bounces straight back in.
   With KV tiers (a `KVLoader`), an admitted sequence whose prefix continues in host memory or on
   disk waits in LOADING_KV, holding its blocks but taking no budget, while the copies run (the
   batcher polls those loads before each plan: engine/sequence_queues.py).
Admission allocates blocks for every known token, so prefill chunks never allocate: only decodes do.
A sequence in a plan still in flight is never planned again nor chosen as a preemption victim, and
with a `pipeline_depth` of P a plan takes at most a 1/P share of the sequences that could run
(engine/batcher.py says why).

Speculative decoding: with a `DraftProposer`, a decode of a sequence that asks for drafts carries a
draft to verify in the same pass (sized and placed by engine/speculative/decode_draft.py).
"""

from __future__ import annotations

from engine.batch import BatchPlan, ScheduledChunk
from engine.config import BatcherConfig
from engine.errors import OutOfBlocksError
from engine.in_flight import InFlightPlans
from engine.sequence import Sequence, SequenceStatus
from engine.sequence_queues import SequenceQueues
from engine.speculative.base import DraftProposer
from engine.speculative.decode_draft import DraftRoom, place_draft
from engine.step_chunks import next_chunk


class StepPlanner:
    """Plans over the batcher's queues and reads its plans in flight; never records a step. Not
    thread-safe."""

    def __init__(self, config: BatcherConfig, queues: SequenceQueues, in_flight: InFlightPlans,
                 proposer: DraftProposer | None, max_num_tokens: int, pipeline_depth: int) -> None:
        self.config = config
        self._queues = queues
        self._block_manager = queues.block_manager
        self._in_flight = in_flight
        self._proposer = proposer
        self._max_num_tokens = max_num_tokens
        self._pipeline_depth = pipeline_depth
        self._copies: list[tuple[int, int]] = []  # this plan's copy-on-write block copies
        self._plan_seqs = config.max_num_seqs  # this plan's chunk limit (`_plan_limit`)

    def plan(self) -> BatchPlan:
        """The next step's plan (see the module docstring for the order and the limits)."""
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self._plan_seqs = self._plan_limit()
        budget = self._schedule_decodes(chunks, preempted, self.config.max_num_batched_tokens)
        budget = self._schedule_prefills(chunks, budget)
        if not preempted:
            self._admit(chunks, budget)
        copies, self._copies = tuple(self._copies), []
        return BatchPlan(chunks=tuple(chunks), preempted=tuple(preempted), block_copies=copies)

    def _schedule_decodes(self, chunks: list[ScheduledChunk], preempted: list[str], budget: int) -> int:
        """Schedule every running decode that fits, with its draft if any; returns the budget left."""
        running = self._queues.running  # shrinks while this runs when a decode preempts
        i = 0
        while i < len(running) and budget > 0 and len(chunks) < self._plan_seqs:
            seq = running[i]
            i += 1
            if seq.num_pending_tokens != 1 or self._in_flight.holds(seq):
                continue  # still prefilling (the next pass), or its last token is not back yet
            draft = self._draft(seq, len(running) - i, budget) if seq.sampling.num_draft_tokens else ()
            if not self._grow_for_decode(seq, preempted):
                break  # seq preempted itself: it was the newest, nothing runs after it
            chunks.append(next_chunk(seq, 1, draft))
            budget -= 1 + len(draft)
        return budget

    def _draft(self, seq: Sequence, later: int, budget: int) -> tuple[int, ...]:
        """A draft for seq's decode; budget and free blocks beyond one token for each of the `later`
        running sequences may go to it. Only called for sequences that ask for drafts: building the
        room per decode cost every plain decode ~1 us of host time per step."""
        room = DraftRoom(budget=budget - later - 1, blocks=self._block_manager.num_free_blocks - later)
        return place_draft(seq, room, self._proposer, self._block_manager, self._max_num_tokens)

    def _grow_for_decode(self, seq: Sequence, preempted: list[str]) -> bool:
        """Make room for seq's next token, preempting newest-first; False when seq itself went."""
        while True:
            try:
                self._own_write_block(seq)
                self._block_manager.append_slots(seq.block_ids, seq.num_tokens)
                return True
            except OutOfBlocksError:
                victim = self._newest_preemptible()  # never one scheduled earlier in this pass
                self._queues.preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    return False

    def _schedule_prefills(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Continue chunked prefills of admitted sequences; returns the budget left."""
        for seq in self._queues.running:
            if budget <= 0 or len(chunks) >= self._plan_seqs:
                break
            if seq.num_pending_tokens > 1 and not self._in_flight.holds(seq):
                n = min(seq.num_pending_tokens, self.config.max_prefill_chunk, budget)
                chunks.append(next_chunk(seq, n))
                budget -= n
        return budget

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Admit waiting sequences in queue order while budget, sequence slots and blocks last."""
        queues = self._queues
        while queues.waiting and budget > 0 and len(chunks) < self._plan_seqs:
            if queues.num_holding_slots >= self.config.max_num_seqs:
                return
            seq = queues.waiting.head()
            try:
                block_ids, num_cached = self._block_manager.allocate_for_prompt(seq.all_token_ids,
                                                                                num_extra_slots=1)
            except OutOfBlocksError:
                return  # head-of-line: later (maybe smaller) sequences do not overtake it
            queues.waiting.pop_head()
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_cached  # a resumed sequence keeps its first admission's count
            seq.block_ids, seq.num_computed_tokens = block_ids, num_cached
            if queues.loading.start(seq):
                continue
            queues.run(seq)
            n = min(seq.num_pending_tokens, self.config.max_prefill_chunk, budget)
            chunks.append(next_chunk(seq, n))
            budget -= n

    def _own_write_block(self, seq: Sequence) -> None:
        """Copy-on-write: the block the next token's KV goes into must be seq's alone (forked choices
        share their prompt's last, partly filled block). Raises OutOfBlocksError, changing nothing."""
        index = seq.num_computed_tokens // self._block_manager.block_size
        if index < len(seq.block_ids):
            copy = self._block_manager.copy_on_write(seq.block_ids, index)
            if copy is not None:
                self._copies.append(copy)

    def _plan_limit(self) -> int:
        """Chunks this plan may hold: `max_num_seqs`, or with P plans in flight a 1/P share (rounded up)
        of the sequences that could run, so the plans in flight split them evenly."""
        if self._pipeline_depth == 1:
            return self.config.max_num_seqs
        share = -(-(len(self._queues.running) + len(self._queues.waiting)) // self._pipeline_depth)
        return max(1, min(self.config.max_num_seqs, share))

    def _newest_preemptible(self) -> Sequence:
        """The newest running sequence not in flight: a stage may still write an in-flight one's blocks,
        and its plan's postprocess would advance it. The sequence being grown is never in flight, so
        there always is one, and it or a newer one is chosen."""
        return next(seq for seq in reversed(self._queues.running) if not self._in_flight.holds(seq))
