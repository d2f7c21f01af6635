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

What a step runs (decodes, prefill chunks, admissions; speculative drafts) is engine/step_planner.py's
call; the queue each sequence waits in is engine/sequence_queues.py's. Here: the request calls, and
the step's bookkeeping (`schedule` hands the plan to the in-flight list, `postprocess` records it: only
the accepted drafts of a verify chunk count as computed and are appended).

The batcher never finishes a sequence on its own: stop tokens, stop strings, max_tokens and the
length limit are the engine's call, through `finish`. The length limit is `max_num_tokens`, the smaller
of the context window and the KV pool: the engine must finish a sequence once `num_tokens >=
max_num_tokens`, or a sequence larger than the whole pool would preempt itself and never fit again.
"""

from __future__ import annotations

import logging

from engine.batch import BatchPlan, StepResult
from engine.block_manager import BlockManager
from engine.config import BatcherConfig
from engine.errors import EngineError, InvalidRequestError
from engine.in_flight import InFlightPlans
from engine.kv_tiers.types import KVLoader
from engine.outputs import FinishReason
from engine.sequence import Sequence, SequenceStatus
from engine.sequence_checks import check_new_sequence
from engine.sequence_queues import SequenceQueues
from engine.speculative.base import DraftProposer
from engine.step_chunks import accepted_draft
from engine.step_planner import StepPlanner

log = logging.getLogger(__name__)


class Batcher:
    """Owns the sequence queues (engine/sequence_queues.py) and every block table. Not thread-safe."""

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
        self._queues = SequenceQueues(block_manager, loader)
        self._in_flight = InFlightPlans(pipeline_depth)  # scheduled plans until postprocess (engine/in_flight.py)
        self._proposer = proposer
        self._planner = StepPlanner(config, self._queues, self._in_flight, proposer, self.max_num_tokens,
                                    pipeline_depth)

    # ---- queries --------------------------------------------------------------------------------
    def get(self, request_id: str) -> Sequence | None:
        return self._queues.seqs.get(request_id)

    @property
    def num_unfinished(self) -> int:
        """Sequences held in any state, including those waiting for remote KV."""
        return len(self._queues.seqs)

    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    @property
    def num_waiting(self) -> int:
        return len(self._queues.waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return len(self._queues.remote)

    @property
    def num_loading_kv(self) -> int:
        """Admitted sequences waiting for their prefix to be copied up from a lower KV tier."""
        return len(self._queues.loading)

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens still to be prefilled here: queued work for the scheduler's TTFT
        predictions. A running decode's single pending token does not count."""
        return sum(seq.num_pending_tokens for seq in self._queues.prefilling())

    @property
    def num_pending_prefill_requests(self) -> int:
        """The prompts `num_pending_prefill_tokens` belongs to. The scheduler prices a backlog per prompt
        (attention grows with each prompt's length), so it needs both numbers from one view."""
        return sum(1 for _ in self._queues.prefilling())

    @property
    def num_running_context_tokens(self) -> int:
        """Summed context of the running sequences: a decode step's cost grows with it (attention reads
        every context token's KV), so the scheduler prices the batch by it."""
        return sum(seq.num_tokens for seq in self._queues.running)

    @property
    def num_running_remaining_tokens(self) -> int:
        """Tokens the running sequences may still generate (max_tokens minus those out): how soon their
        slots free. A scheduler that guessed it saw a just-started sequence as half done."""
        return sum(max(seq.sampling.max_tokens - seq.num_output_tokens, 0) for seq in self._queues.running)

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
        return self._queues.num_preemptions

    def has_work(self) -> bool:
        """Whether `schedule()` may return a non-empty plan (remote-KV waits alone are not work)."""
        return bool(self._queues.waiting or self._queues.running or self._queues.loading)

    # ---- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises InvalidRequestError, changing nothing, on bad input."""
        self._check_new(seq)
        self._queues.track(seq, SequenceStatus.WAITING)
        self._queues.waiting.push_new(seq)

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
        self._queues.track(seq, SequenceStatus.WAITING_FOR_REMOTE_KV)
        seq.block_ids, seq.num_cached_tokens, seq.num_computed_tokens = block_ids, num_cached, num_cached
        self._queues.remote[seq.request_id] = seq
        return list(block_ids), num_cached

    def commit_remote(self, request_id: str, first_token_id: int) -> Sequence:
        """The remote prefill's KV has landed: register it as computed and join the decode batch.

        Appends the prefill's first token, so the sequence's next step is a decode. Raises KeyError when
        `request_id` is not waiting for remote KV (e.g. it was aborted meanwhile).
        """
        seq = self._queues.remote.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.mark_computed(seq.block_ids, seq.all_token_ids, seq.num_computed_tokens)
        seq.append_token(first_token_id)
        self._queues.run(seq)
        return seq

    def fork(self, parent_id: str, child: Sequence, first_token_id: int) -> Sequence:
        """A sibling choice of a running sequence whose prompt is computed (n > 1): `child` (same prompt,
        its own sampling) shares the parent's prompt blocks by reference and joins the decode batch with
        its own first token. The partly filled last prompt block is copied when a sharer first writes
        into it (engine/step_planner.py), so KV use is prompt + n x generated. Raises KeyError when the
        parent is not running, InvalidRequestError when `child` is not new or not the parent's prompt."""
        parent = self._queues.seqs[parent_id]
        if parent.status is not SequenceStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens:
            raise KeyError(f"{parent_id!r} has no computed prompt to fork from")
        self._check_new(child)
        if child.prompt_token_ids != parent.prompt_token_ids:
            raise InvalidRequestError(f"fork {child.request_id!r} does not share {parent_id!r}'s prompt")
        num_prompt_blocks = self.block_manager.blocks_for(child.num_prompt_tokens)
        child.block_ids = self.block_manager.share(parent.block_ids[:num_prompt_blocks])
        child.num_computed_tokens = child.num_prompt_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self._queues.track(child, SequenceStatus.RUNNING)
        child.append_token(first_token_id)
        self._queues.run(child)
        return child

    def abort(self, request_id: str) -> bool:
        """Drop a sequence in any state, freeing every block it holds. Returns whether it existed.

        Dangerous window: for WAITING_FOR_REMOTE_KV the blocks are reusable at once, so the caller must
        first make sure no remote WRITE into them is still in flight (wait for or cancel the transfer).
        """
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """The engine's verdict that a sequence is done: free its blocks and forget it."""
        seq = self._queues.remove(request_id)
        if seq is None:
            return False
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
        seq = self._queues.seqs[request_id]
        block_ids, seq.block_ids = seq.block_ids, []  # finish() then frees nothing
        self.finish(request_id, FinishReason.LENGTH)
        return block_ids

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> BatchPlan:
        """Plan the next step (engine/step_planner.py), once the sequences whose tier loads finished
        have joined the running list."""
        self._queues.finish_loads()
        plan = self._planner.plan()
        if plan.chunks:
            self._in_flight.add(plan, {c.request_id: self._queues.seqs[c.request_id] for c in plan.chunks})
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
            if seq is None or self._queues.seqs.get(chunk.request_id) is not seq:
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

    def _check_new(self, seq: Sequence) -> None:
        check_new_sequence(seq, self._queues.seqs, self.max_num_tokens, self.max_model_len)
