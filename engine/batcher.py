"""Iteration-level scheduling: which tokens of which sequences run in the next engine step.

One step is `plan = batcher.schedule()`, `result = runner.execute(plan)`, `batcher.postprocess(plan,
result)`. Between steps the engine may `add`, `abort`, `finish`, `reserve_remote`, `commit_remote`.
Batches in flight: under an overlapped pipeline the engine schedules up to one plan per stage before
the oldest is postprocessed (in schedule order). A sequence is in at most one plan in flight: until
its plan is postprocessed it is never scheduled again nor chosen as a preemption victim, so its next
token is known before its next chunk is planned, and its blocks stay its own while a stage may still
write them. With a `pipeline_depth` of P, a plan takes at most 1/P of the sequences that could run
(running and waiting), so that the next plans find sequences of their own and the P batches in
flight are of about equal size; greedy plans would take every sequence and leave the rest empty.
`drop_in_flight` forgets the plans of a step that failed.

A step's plan, under a token budget of `max_num_batched_tokens` and at most `max_num_seqs` chunks:
1. decodes (running sequences with one pending token), oldest first; a decode that needs a new block
   when the pool is empty preempts the newest running sequence (possibly itself) by recompute;
2. chunks of running sequences still prefilling, oldest first, at most `max_prefill_chunk` each;
3. admission of waiting sequences, preempted ones first, then by `sampling.priority` (lower first, FIFO
   within one priority; strict, so a stream of high-priority work can hold lower work back), each only
   when blocks for all its tokens plus one generated token are available; skipped in a step that
   preempted, so a preempted sequence never bounces straight back in.
   With KV tiers (a `KVLoader`), an admitted sequence whose prefix continues in host memory or on
   disk waits in LOADING_KV, holding its blocks but taking no budget, while the copies run; each
   `schedule()` first polls those loads, and a finished one joins the running list with the loaded
   tokens computed (a failed block and everything after it is simply prefilled: same output).
Admission allocates blocks for every known token, so prefill chunks never allocate: only decodes do.

Speculative decoding: with a `DraftProposer`, a decode of a sequence that asks for drafts carries a
draft to verify in the same pass (sized and placed by engine/speculative/decode_draft.py); in
`postprocess` only the accepted drafts count as computed and are appended.

The batcher never finishes a sequence on its own: stop tokens, stop strings, max_tokens and the
length limit are the engine's call, through `finish`. The length limit is `max_num_tokens`, the smaller
of the context window and the KV pool: the engine must finish a sequence once `num_tokens >=
max_num_tokens`, or a sequence larger than the whole pool would preempt itself and never fit again.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator

from engine.batch import BatchPlan, ScheduledChunk, StepResult
from engine.block_manager import BlockManager
from engine.config import BatcherConfig
from engine.errors import EngineError, InvalidRequestError, OutOfBlocksError
from engine.in_flight import InFlightPlans
from engine.kv_tiers.types import KVLoader
from engine.outputs import FinishReason
from engine.sequence import Sequence, SequenceStatus
from engine.sequence_checks import check_new_sequence
from engine.speculative.base import DraftProposer
from engine.speculative.decode_draft import DraftRoom, place_draft
from engine.step_chunks import accepted_draft, next_chunk
from engine.tier_load_queue import TierLoadQueue
from engine.waiting_queue import WaitingQueue

log = logging.getLogger(__name__)


def _arrival(seq: Sequence) -> int:
    """Sort key of the running list: oldest first, so preemption victims come from the end."""
    return seq.arrival_order


class Batcher:
    """Owns the waiting / running / remote queues and every block table. Not thread-safe."""

    def __init__(self, config: BatcherConfig, block_manager: BlockManager, max_model_len: int,
                 proposer: DraftProposer | None = None, loader: KVLoader | None = None,
                 pipeline_depth: int = 1) -> None:
        """`proposer`: drafts for sequences that ask for speculative decoding; None never drafts.
        `loader`: promotes prefix blocks from lower KV tiers; None: the GPU pool is the only tier.
        `pipeline_depth`: plans the engine keeps in flight (module docstring); 1: one step at a time."""
        pool_tokens = block_manager.num_total_blocks * block_manager.block_size
        if pool_tokens < max_model_len:
            log.warning("the KV pool holds %d tokens, fewer than max_model_len %d: sequences stop there",
                        pool_tokens, max_model_len)
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len  # the model's context window
        # Longest a sequence may grow (see the module docstring); prompts must be shorter.
        self.max_num_tokens = min(max_model_len, pool_tokens)
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence, whatever its state
        self._waiting = WaitingQueue()  # WAITING / PREEMPTED, admission order
        self._running: list[Sequence] = []  # RUNNING, sorted by arrival_order (oldest first)
        self._remote: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV: hold blocks, not scheduled
        self._loading = TierLoadQueue(loader)  # LOADING_KV: hold blocks a lower tier copies into
        self._in_flight = InFlightPlans(pipeline_depth)  # scheduled plans until postprocess (engine/in_flight.py)
        self._copies: list[tuple[int, int]] = []  # this plan's copy-on-write block copies
        self._next_arrival = 0  # arrival_order of the next added sequence
        self._num_preemptions = 0  # since start, for metrics
        self._proposer = proposer
        self._pipeline_depth = pipeline_depth
        self._plan_seqs = config.max_num_seqs  # this plan's chunk limit (`_plan_limit`)

    # ---- queries --------------------------------------------------------------------------------
    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    @property
    def num_unfinished(self) -> int:
        """Sequences held in any state, including those waiting for remote KV."""
        return len(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return len(self._remote)

    @property
    def num_loading_kv(self) -> int:
        """Admitted sequences waiting for their prefix to be copied up from a lower KV tier."""
        return len(self._loading)

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens still to be prefilled here: queued work for the scheduler's TTFT
        predictions. A running decode's single pending token does not count."""
        return sum(seq.num_pending_tokens for seq in self._prefilling())

    @property
    def num_pending_prefill_requests(self) -> int:
        """The prompts `num_pending_prefill_tokens` belongs to. The scheduler prices a backlog per prompt
        (attention grows with each prompt's length), so it needs both numbers from one view."""
        return sum(1 for _ in self._prefilling())

    @property
    def num_running_context_tokens(self) -> int:
        """Summed context of the running sequences: a decode step's cost grows with it (attention reads
        every context token's KV), so the scheduler prices the batch by it."""
        return sum(seq.num_tokens for seq in self._running)

    @property
    def num_running_remaining_tokens(self) -> int:
        """Tokens the running sequences may still generate (max_tokens minus those out): how soon their
        slots free. A scheduler that guessed it saw a just-started sequence as half done."""
        return sum(max(seq.sampling.max_tokens - seq.num_output_tokens, 0) for seq in self._running)

    def _prefilling(self) -> Iterator[Sequence]:
        """Sequences with prompt (or recompute) tokens still to prefill: waiting, or running part-way
        through their chunks."""
        yield from self._waiting
        yield from (seq for seq in self._running if seq.num_pending_tokens > 1)

    @property
    def num_in_flight(self) -> int:
        """Plans scheduled and not yet postprocessed (more than one only under an overlapped pipeline)."""
        return len(self._in_flight)

    def in_flight_request_ids(self) -> list[tuple[str, ...]]:
        """The request ids of each plan in flight, oldest plan first."""
        return self._in_flight.request_ids()

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start (each costs a recompute of the victim's tokens)."""
        return self._num_preemptions

    def has_work(self) -> bool:
        """Whether `schedule()` may return a non-empty plan (remote-KV waits alone are not work)."""
        return bool(self._waiting or self._running or self._loading)

    # ---- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises InvalidRequestError, changing nothing, on bad input."""
        self._check_new(seq)
        self._track(seq, SequenceStatus.WAITING)
        self._waiting.push_new(seq)

    def reserve_remote(self, seq: Sequence) -> tuple[list[int], int]:
        """Decode side of disaggregation: allocate the prompt's blocks for a remote prefill to write.

        Returns (block ids, prompt tokens already cached here: the remote prefill starts there). The
        sequence waits in WAITING_FOR_REMOTE_KV, holding its blocks, until `commit_remote`. It counts
        toward `max_num_seqs` for local admissions but is never refused for it (the caller has routed it
        here). Raises InvalidRequestError or OutOfBlocksError, changing nothing.
        """
        self._check_new(seq)
        block_ids, num_cached = self.block_manager.allocate_for_prompt(seq.prompt_token_ids,
                                                                       num_extra_slots=1)
        self._track(seq, SequenceStatus.WAITING_FOR_REMOTE_KV)
        seq.block_ids, seq.num_cached_tokens, seq.num_computed_tokens = block_ids, num_cached, num_cached
        self._remote[seq.request_id] = seq
        return list(block_ids), num_cached

    def commit_remote(self, request_id: str, first_token_id: int) -> Sequence:
        """The remote prefill's KV has landed: register it as computed and join the decode batch.

        Appends the prefill's first token, so the sequence's next step is a decode. Raises KeyError when
        `request_id` is not waiting for remote KV (e.g. it was aborted meanwhile).
        """
        seq = self._remote.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.mark_computed(seq.block_ids, seq.all_token_ids, seq.num_computed_tokens)
        seq.append_token(first_token_id)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self._running, seq, key=_arrival)
        return seq

    def fork(self, parent_id: str, child: Sequence, first_token_id: int) -> Sequence:
        """A sibling choice of a running sequence whose prompt is computed (n > 1): `child` (same prompt,
        its own sampling) shares the parent's prompt blocks by reference and joins the decode batch with
        its own first token. The partly filled last prompt block is copied when a sharer first writes
        into it (`_grow_for_decode`), so KV use is prompt + n x generated. Raises KeyError when the parent
        is not running, InvalidRequestError when `child` is not new or not the parent's prompt."""
        parent = self._seqs[parent_id]
        if parent.status is not SequenceStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens:
            raise KeyError(f"{parent_id!r} has no computed prompt to fork from")
        self._check_new(child)
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise InvalidRequestError(f"fork {child.request_id!r} does not share {parent_id!r}'s prompt")
        num_prompt_blocks = self.block_manager.blocks_for(child.num_prompt_tokens)
        child.block_ids = self.block_manager.share(parent.block_ids[:num_prompt_blocks])
        child.num_computed_tokens = child.num_prompt_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self._track(child, SequenceStatus.RUNNING)
        child.append_token(first_token_id)
        bisect.insort(self._running, child, key=_arrival)
        return child

    def abort(self, request_id: str) -> bool:
        """Drop a sequence in any state, freeing every block it holds. Returns whether it existed.

        Dangerous window: for WAITING_FOR_REMOTE_KV the blocks are reusable at once, so the caller must
        first make sure no remote WRITE into them is still in flight (wait for or cancel the transfer).
        """
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """The engine's verdict that a sequence is done: free its blocks and forget it."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self._remote[request_id]
        elif seq.status is SequenceStatus.LOADING_KV:
            self._loading.cancel(request_id)  # returns once no copy writes into its blocks
        else:
            self._waiting.remove(seq)
        self._free_blocks(seq)
        if self._proposer is not None:
            self._proposer.forget(request_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        return True

    def detach(self, request_id: str) -> list[int]:
        """Finish a sequence but hand its block table to the caller instead of freeing it.

        For a prefill worker that must keep a prompt's KV alive while NIXL reads it: the caller now
        owns one reference to each returned block and must `block_manager.free` them exactly once.
        Raises KeyError when `request_id` is unknown.
        """
        seq = self._seqs[request_id]
        block_ids, seq.block_ids = seq.block_ids, []  # finish() then frees nothing
        self.finish(request_id, FinishReason.LENGTH)
        return block_ids

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Plan the next step (see the module docstring for the order and the limits)."""
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self._finish_loads()
        self._plan_seqs = self._plan_limit()
        budget = self._schedule_decodes(chunks, preempted, self.config.max_num_batched_tokens)
        budget = self._schedule_prefills(chunks, budget)
        if not preempted:
            self._admit(chunks, budget)
        copies, self._copies = tuple(self._copies), []
        plan = BatchPlan(chunks=tuple(chunks), preempted=tuple(preempted), block_copies=copies)
        if chunks:
            self._in_flight.add(plan, {c.request_id: self._seqs[c.request_id] for c in chunks})
        return plan

    def postprocess(self, plan: BatchPlan, result: StepResult) -> list[Sequence]:
        """Record a step: advance computed tokens, append sampled (and accepted draft) tokens, register
        full blocks.

        Returns the sequences that got tokens, in plan order; the engine then decides which finished.
        Sequences aborted or finished since `schedule()` are skipped. Plans are postprocessed in the
        order they were scheduled; raises EngineError for any other plan (an empty one is a no-op).
        """
        if plan.is_empty:
            return []
        scheduled = self._in_flight.pop_oldest(plan)
        got_token: list[Sequence] = []
        for chunk in plan.chunks:
            seq = scheduled.get(chunk.request_id)
            if seq is None or self._seqs.get(chunk.request_id) is not seq:
                continue
            accepted = accepted_draft(chunk, result)
            seq.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens + len(accepted)
            if chunk.needs_sample:
                sampled = result.sampled.get(chunk.request_id)
                if sampled is None:
                    raise EngineError(f"the model runner returned no token for {chunk.request_id!r}")
                for token in (*accepted, sampled):
                    seq.append_token(token.token_id, token.logprobs)
                got_token.append(seq)
            self.block_manager.mark_computed(seq.block_ids, seq.all_token_ids, seq.num_computed_tokens)
        return got_token

    def drop_in_flight(self) -> None:
        """Forget every plan in flight (a step failed): their sequences are schedulable again, their
        tokens still to compute."""
        self._in_flight.clear()

    def discard_dropped(self, plan: BatchPlan) -> bool:
        """Whether `plan`, leaving the pipeline, was dropped by `drop_in_flight`: then it is not to be
        postprocessed (its sequences were planned again)."""
        return self._in_flight.discard_dropped(plan)

    def _schedule_decodes(self, chunks: list[ScheduledChunk], preempted: list[str], budget: int) -> int:
        """Schedule every running decode that fits, with its draft if any; returns the budget left."""
        i = 0
        while i < len(self._running) and budget > 0 and len(chunks) < self._plan_seqs:
            seq = self._running[i]
            i += 1
            if seq.num_pending_tokens != 1 or self._in_flight.holds(seq):
                continue  # still prefilling (the next pass), or its last token is not back yet
            draft = self._draft(seq, len(self._running) - i, budget) if seq.sampling.num_draft_tokens else ()
            if not self._grow_for_decode(seq, preempted):
                break  # seq preempted itself: it was the newest, nothing runs after it
            chunks.append(next_chunk(seq, 1, draft))
            budget -= 1 + len(draft)
        return budget

    def _draft(self, seq: Sequence, later: int, budget: int) -> tuple[int, ...]:
        """A draft for seq's decode; budget and free blocks beyond one token for each of the `later`
        running sequences may go to it. Only called for sequences that ask for drafts: building the
        room per decode cost every plain decode ~1 us of host time per step."""
        room = DraftRoom(budget=budget - later - 1, blocks=self.block_manager.num_free_blocks - later)
        return place_draft(seq, room, self._proposer, self.block_manager, self.max_num_tokens)

    def _grow_for_decode(self, seq: Sequence, preempted: list[str]) -> bool:
        """Make room for seq's next token, preempting newest-first; False when seq itself went."""
        while True:
            try:
                self._own_write_block(seq)
                self.block_manager.append_slots(seq.block_ids, seq.num_tokens)
                return True
            except OutOfBlocksError:
                victim = self._newest_preemptible()  # never one scheduled earlier in this pass
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    return False

    def _schedule_prefills(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Continue chunked prefills of admitted sequences; returns the budget left."""
        for seq in self._running:
            if budget <= 0 or len(chunks) >= self._plan_seqs:
                break
            if seq.num_pending_tokens > 1 and not self._in_flight.holds(seq):
                n = min(seq.num_pending_tokens, self.config.max_prefill_chunk, budget)
                chunks.append(next_chunk(seq, n))
                budget -= n
        return budget

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Admit waiting sequences in queue order while budget, sequence slots and blocks last."""
        while self._waiting and budget > 0 and len(chunks) < self._plan_seqs:
            if len(self._running) + len(self._remote) + len(self._loading) >= self.config.max_num_seqs:
                return
            seq = self._waiting.head()
            try:
                block_ids, num_cached = self.block_manager.allocate_for_prompt(seq.all_token_ids,
                                                                               num_extra_slots=1)
            except OutOfBlocksError:
                return  # head-of-line: later (maybe smaller) sequences do not overtake it
            self._waiting.pop_head()
            if seq.status is SequenceStatus.WAITING:
                seq.num_cached_tokens = num_cached  # a resumed sequence keeps its first admission's count
            seq.block_ids, seq.num_computed_tokens = block_ids, num_cached
            if self._loading.start(seq):
                continue
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_arrival)
            n = min(seq.num_pending_tokens, self.config.max_prefill_chunk, budget)
            chunks.append(next_chunk(seq, n))
            budget -= n

    # ---- KV tiers -------------------------------------------------------------------------------
    def _finish_loads(self) -> None:
        """Move sequences whose load finished to the running list, the landed tokens computed."""
        for seq, loaded in self._loading.finished():
            seq.num_computed_tokens += loaded
            if seq.num_preemptions == 0:
                seq.num_cached_tokens += loaded
                seq.num_tier_loaded_tokens = loaded
            self.block_manager.mark_computed(seq.block_ids, seq.all_token_ids, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_arrival)

    # ---- helpers --------------------------------------------------------------------------------
    def _own_write_block(self, seq: Sequence) -> None:
        """Copy-on-write: the block the next token's KV goes into must be seq's alone (forked choices
        share their prompt's last, partly filled block). Raises OutOfBlocksError, changing nothing."""
        index = seq.num_computed_tokens // self.block_manager.block_size
        if index < len(seq.block_ids):
            copy = self.block_manager.copy_on_write(seq.block_ids, index)
            if copy is not None:
                self._copies.append(copy)

    def _plan_limit(self) -> int:
        """Chunks this plan may hold: `max_num_seqs`, or with P plans in flight a 1/P share (rounded up)
        of the sequences that could run, so the plans in flight split them evenly."""
        if self._pipeline_depth == 1:
            return self.config.max_num_seqs
        share = -(-(len(self._running) + len(self._waiting)) // self._pipeline_depth)
        return max(1, min(self.config.max_num_seqs, share))

    def _newest_preemptible(self) -> Sequence:
        """The newest running sequence not in flight: a stage may still write an in-flight one's blocks,
        and its plan's postprocess would advance it. The sequence being grown is never in flight, so
        there always is one, and it or a newer one is chosen."""
        return next(seq for seq in reversed(self._running) if not self._in_flight.holds(seq))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free the blocks, keep the tokens, requeue at the front."""
        self._running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self._waiting.push_preempted(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
        seq.block_ids = []

    def _check_new(self, seq: Sequence) -> None:
        check_new_sequence(seq, self._seqs, self.max_num_tokens, self.max_model_len)

    def _track(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status, seq.arrival_order = status, self._next_arrival
        self._next_arrival += 1
        self._seqs[seq.request_id] = seq
