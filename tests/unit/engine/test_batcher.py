"""Behaviour of the iteration-level batcher, driven by a fake runner that samples a fixed token
(test_batcher_random.py drives it with random traffic)."""

from __future__ import annotations

import pytest
from batcher_helpers import BS, TOKEN, free_blocks, held, make, run, seq, shape, step

from engine.batch import BatchPlan, SampledToken, StepResult
from engine.batcher import Batcher
from engine.block_manager import BlockManager, KVEventKind
from engine.config import BatcherConfig
from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from tokenization.block_hashes import block_hashes


# ---- chunked prefill and decode -------------------------------------------------------------------
def test_prompt_is_prefilled_in_chunks_then_decoded_one_token_at_a_time() -> None:
    b = make(chunk=4)
    b.add(seq("a", 10))
    assert [shape(step(b)) for _ in range(4)] == [
        [("a", 0, 4, False)], [("a", 4, 4, False)], [("a", 8, 2, True)], [("a", 10, 1, True)]]
    assert held(b, "a").output_token_ids == [TOKEN, TOKEN]


def test_decode_chunk_carries_the_last_token_and_a_covering_block_table() -> None:
    b = make()
    b.add(seq("a", 8))
    step(b)
    (chunk,) = b.schedule().chunks
    assert chunk.token_ids == (TOKEN,) and chunk.start_pos == 8
    assert len(chunk.block_ids) * BS >= chunk.context_len


def test_chunks_never_exceed_the_step_budget() -> None:
    b = make(budget=8, max_num_seqs=4)
    b.add(seq("a", 10))
    b.add(seq("b", 10, start=300))
    plans = [step(b) for _ in range(4)]
    assert [shape(p) for p in plans[:3]] == [
        [("a", 0, 8, False)],
        [("a", 8, 2, True), ("b", 0, 6, False)],
        [("a", 10, 1, True), ("b", 6, 4, True)],
    ]
    assert all(p.num_tokens <= 8 for p in plans)


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    b = make()
    b.add(seq("a", 4))
    step(b)
    b.add(seq("b", 12, start=300))
    b.add(seq("c", 12, start=500))
    assert shape(b.schedule()) == [("a", 4, 1, True), ("b", 0, 12, True), ("c", 0, 12, True)]


def test_postprocess_returns_only_sequences_that_sampled() -> None:
    b = make(chunk=4)
    b.add(seq("a", 6))
    b.add(seq("b", 2, start=300))
    plan = b.schedule()
    got = b.postprocess(plan, run(plan))
    assert [s.request_id for s in got] == ["b"]
    assert held(b, "a").num_computed_tokens == 4 and held(b, "a").output_token_ids == []


def test_max_num_seqs_caps_running_sequences() -> None:
    b = make(max_num_seqs=2)
    for rid in "abc":
        b.add(seq(rid, 4))
    assert [c.request_id for c in step(b).chunks] == ["a", "b"]
    b.finish("a", FinishReason.STOP)
    assert [c.request_id for c in step(b).chunks] == ["b", "c"]


def prioritized(rid: str, priority: int, start: int) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(range(start, start + 4)),
                    sampling=SamplingParams(priority=priority))


def test_waiting_sequences_are_admitted_by_priority_then_first_come_first_served() -> None:
    b = make(max_num_seqs=1)
    b.add(prioritized("running", 2, 100))
    step(b)
    for rid, priority, start in [("free1", 2, 200), ("ent1", 0, 300), ("plus", 1, 400), ("ent2", 0, 500),
                                 ("free2", 2, 600)]:
        b.add(prioritized(rid, priority, start))
    admitted = []
    for rid in ["running", "ent1", "ent2", "plus", "free1"]:
        b.finish(rid, FinishReason.STOP)
        admitted.append(step(b).chunks[0].request_id)
    assert admitted == ["ent1", "ent2", "plus", "free1", "free2"]


def test_a_preempted_sequence_stays_ahead_of_higher_priority_newcomers() -> None:
    b = make(num_blocks=6, max_model_len=24)  # as `preempting_batcher`, the victim "b" of the lowest priority
    b.add(Sequence(request_id="a", prompt_token_ids=list(range(100, 107)), sampling=SamplingParams(priority=0)))
    b.add(Sequence(request_id="b", prompt_token_ids=list(range(300, 307)), sampling=SamplingParams(priority=2)))
    assert step_until_preemption(b).preempted == ("b",)
    b.add(prioritized("urgent", 0, 700))
    b.finish("a", FinishReason.STOP)
    assert step(b).chunks[0].request_id == "b"  # it held blocks before: it resumes first


def test_a_negative_priority_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="priority"):
        SamplingParams(priority=-1)


def test_admission_waits_until_blocks_for_all_tokens_plus_one_are_free() -> None:
    b = make(num_blocks=8, max_model_len=32)
    b.add(seq("a", 16))  # 17 slots: 5 blocks
    b.add(seq("b", 12, start=300))  # 13 slots: 4 blocks, only 3 left
    assert [c.request_id for c in step(b).chunks] == ["a"]
    assert held(b, "b").status is SequenceStatus.WAITING and free_blocks(b) == 3
    b.finish("a", FinishReason.STOP)
    assert [c.request_id for c in step(b).chunks] == ["b"]


def test_prefix_cache_hit_skips_computed_tokens_and_is_reported() -> None:
    b = make()
    b.add(seq("a", 10))
    step(b)
    b.add(seq("b", 10))
    (chunk,) = [c for c in b.schedule().chunks if c.request_id == "b"]
    assert (chunk.start_pos, chunk.num_tokens) == (8, 2)
    assert held(b, "b").num_cached_tokens == 8


# ---- preemption -----------------------------------------------------------------------------------
def preempting_batcher() -> Batcher:
    """Two sequences in 6 blocks that run out of room on a decode after a few steps."""
    b = make(num_blocks=6, max_model_len=24)
    b.add(seq("a", 7))
    b.add(seq("b", 7, start=300))
    return b


def step_until_preemption(b: Batcher) -> BatchPlan:
    for _ in range(20):
        plan = step(b)
        if plan.preempted:
            return plan
    raise AssertionError("no preemption")


def test_decode_without_free_blocks_preempts_the_newest_sequence() -> None:
    b = preempting_batcher()
    plan = step_until_preemption(b)
    victim = held(b, "b")
    assert plan.preempted == ("b",) and [c.request_id for c in plan.chunks] == ["a"]
    assert victim.status is SequenceStatus.PREEMPTED and victim.num_preemptions == 1
    assert victim.block_ids == [] and victim.num_computed_tokens == 0
    assert victim.output_token_ids and b.num_waiting == 1
    assert free_blocks(b) + len(held(b, "a").block_ids) == 6


def test_preempted_sequence_recomputes_prompt_and_outputs_then_decodes() -> None:
    b = preempting_batcher()
    step_until_preemption(b)
    victim = held(b, "b")
    outputs_before = list(victim.output_token_ids)
    b.finish("a", FinishReason.STOP)
    (resume,) = step(b).chunks
    assert resume.start_pos > 0 and resume.start_pos % BS == 0  # its own blocks came back from the cache
    assert resume.context_len == len(victim.prompt_token_ids) + len(outputs_before)
    assert resume.needs_sample and victim.status is SequenceStatus.RUNNING
    assert victim.output_token_ids == outputs_before + [TOKEN]
    assert victim.num_cached_tokens == 0  # the first admission's count is what the caller sees


def test_the_newest_sequence_preempts_itself_when_it_needs_a_block() -> None:
    b = make(num_blocks=4, max_model_len=16)
    b.add(seq("a", 5))
    b.add(seq("b", 7, start=300))  # crosses a block boundary first, and is the newest
    step(b)
    step(b)
    plan = step(b)
    assert plan.preempted == ("b",) and [c.request_id for c in plan.chunks] == ["a"]
    assert held(b, "b").status is SequenceStatus.PREEMPTED


def test_preempted_sequences_finish_once_the_pool_frees_up() -> None:
    b = make(num_blocks=4, max_model_len=16)
    seqs = [seq("a", 7), seq("b", 7, start=300)]
    for s in seqs:
        b.add(s)
    for _ in range(40):
        plan = b.schedule()
        for s in b.postprocess(plan, run(plan)):
            if s.num_tokens >= b.max_num_tokens:  # the engine's length rule
                b.finish(s.request_id, FinishReason.LENGTH)
    assert all(s.is_finished and s.num_tokens == 16 for s in seqs)
    assert sum(s.num_preemptions for s in seqs) > 0 and free_blocks(b) == 4


def test_pool_smaller_than_the_context_window_caps_sequence_length() -> None:
    b = make(num_blocks=3, max_model_len=16)
    assert b.max_num_tokens == 12
    with pytest.raises(InvalidRequestError):
        b.add(seq("long", 12))
    b.add(seq("fits", 11))
    assert held(b, "fits").status is SequenceStatus.WAITING


def test_preemptions_are_counted() -> None:
    b = preempting_batcher()
    step_until_preemption(b)
    assert b.num_preemptions == 1


# ---- aborts and finishing -------------------------------------------------------------------------
def into_state(b: Batcher, state: str) -> str:
    """Put request "x" into `state` (another request "y" helps reach the preempted state)."""
    if state == "remote":
        b.reserve_remote(seq("x", 9))
        return "x"
    if state == "preempted":
        b.add(seq("y", 7, start=300))
        b.add(seq("x", 7))
        for _ in range(20):
            if step(b).preempted:
                break
        return "x"
    b.add(seq("x", 9))
    steps = {"waiting": 0, "prefilling": 1, "decoding": 3}[state]
    for _ in range(steps):
        step(b)
    return "x"


STATES = {"waiting": SequenceStatus.WAITING, "prefilling": SequenceStatus.RUNNING,
          "decoding": SequenceStatus.RUNNING, "preempted": SequenceStatus.PREEMPTED,
          "remote": SequenceStatus.WAITING_FOR_REMOTE_KV}


@pytest.mark.parametrize("state", list(STATES))
def test_abort_in_any_state_frees_every_block(state: str) -> None:
    b = make(num_blocks=6, max_model_len=24, chunk=4)
    rid = into_state(b, state)
    target = held(b, rid)
    assert target.status is STATES[state]
    assert b.abort(rid) is True
    assert b.get(rid) is None and target.status is SequenceStatus.FINISHED
    assert target.finish_reason is FinishReason.ABORT and target.block_ids == []
    other = b.get("y")
    if other is not None:
        b.abort("y")
    assert free_blocks(b) == 6 and b.num_unfinished == 0 and not b.has_work()
    assert b.schedule().is_empty


def test_abort_of_an_unknown_or_finished_request_returns_false() -> None:
    b = make()
    b.add(seq("a", 4))
    assert b.abort("nope") is False
    assert b.abort("a") is True and b.abort("a") is False


def test_abort_between_schedule_and_postprocess_skips_the_sequence() -> None:
    b = make()
    b.add(seq("a", 4))
    b.add(seq("b", 4, start=300))
    plan = b.schedule()
    b.abort("a")
    assert [s.request_id for s in b.postprocess(plan, run(plan))] == ["b"]
    assert free_blocks(b) == 32 - len(held(b, "b").block_ids)


def test_finish_frees_blocks_and_records_the_reason() -> None:
    b = make()
    b.add(seq("a", 9))
    step(b)
    target = held(b, "a")
    assert b.finish("a", FinishReason.LENGTH) is True
    assert target.finish_reason is FinishReason.LENGTH and target.is_finished
    assert free_blocks(b) == 32 and b.num_running == 0


# ---- remote prefill (decode side of disaggregation) -----------------------------------------------
def test_reserve_remote_holds_blocks_without_scheduling() -> None:
    b = make()
    block_ids, cached = b.reserve_remote(seq("r", 9))
    assert len(block_ids) == 3 and cached == 0  # 9 prompt tokens + the first generated one
    assert held(b, "r").status is SequenceStatus.WAITING_FOR_REMOTE_KV
    assert free_blocks(b) == 29 and b.num_unfinished == 1
    assert not b.has_work() and b.schedule().is_empty


def test_commit_remote_registers_the_prompt_and_joins_the_decode_batch() -> None:
    b = make()
    prompt = seq("r", 9)
    block_ids, _ = b.reserve_remote(prompt)
    b.block_manager.drain_events()
    b.commit_remote("r", 42)
    events = b.block_manager.drain_events()
    assert [e.block_hash for e in events] == block_hashes(prompt.prompt_token_ids, BS)
    assert all(e.kind is KVEventKind.STORED for e in events)
    assert shape(b.schedule()) == [("r", 9, 1, True)]
    assert prompt.output_token_ids == [42] and prompt.block_ids == block_ids


def test_reserve_remote_reuses_the_local_prefix_cache() -> None:
    b = make()
    b.add(seq("a", 12))
    step(b)
    block_ids, cached = b.reserve_remote(seq("r", 10))
    assert cached == 8 and block_ids[:2] == held(b, "a").block_ids[:2]


def test_reserve_remote_without_blocks_changes_nothing() -> None:
    b = make(num_blocks=4, max_model_len=16)
    b.add(seq("a", 12))
    step(b)
    with pytest.raises(OutOfBlocksError):
        b.reserve_remote(seq("r", 4, start=300))
    assert b.get("r") is None and free_blocks(b) == 0


def test_remote_reservations_count_toward_max_num_seqs() -> None:
    b = make(max_num_seqs=2)
    b.reserve_remote(seq("r1", 4))
    b.reserve_remote(seq("r2", 4, start=300))
    b.add(seq("a", 4, start=500))
    assert b.schedule().is_empty and b.num_waiting == 1


def test_commit_of_an_unknown_request_raises() -> None:
    b = make()
    b.reserve_remote(seq("r", 4))
    b.abort("r")
    with pytest.raises(KeyError):
        b.commit_remote("r", 1)


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [0, 64])
def test_empty_or_too_long_prompts_are_refused(prompt_len: int) -> None:
    b = make(max_model_len=64)
    with pytest.raises(InvalidRequestError):
        b.add(seq("a", prompt_len))
    assert b.num_unfinished == 0


def test_duplicate_request_ids_are_refused() -> None:
    b = make()
    b.add(seq("a", 4))
    with pytest.raises(InvalidRequestError):
        b.add(seq("a", 4))
    with pytest.raises(InvalidRequestError):
        b.reserve_remote(seq("a", 4))


def test_pending_prefill_tokens_count_queued_prompts_not_decodes() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    batcher = Batcher(BatcherConfig(max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=8), bm, 256)
    batcher.add(Sequence(request_id="a", prompt_token_ids=list(range(1, 6)), sampling=SamplingParams()))
    batcher.add(Sequence(request_id="b", prompt_token_ids=list(range(1, 11)), sampling=SamplingParams()))
    assert (batcher.num_pending_prefill_tokens, batcher.num_pending_prefill_requests) == (15, 2)
    plan = batcher.schedule()  # a: all 5 tokens; b: the first 3 (budget 8)
    batcher.postprocess(plan, StepResult(sampled={c.request_id: SampledToken(7) for c in plan.chunks
                                                  if c.needs_sample}))
    assert batcher.num_pending_prefill_tokens == 7  # b's remaining 7; a now only decodes
    # b is running (no longer waiting) part-way through its chunks: still one prompt behind those 7 tokens
    assert (batcher.num_waiting, batcher.num_pending_prefill_requests) == (0, 1)


def test_running_context_counts_every_running_sequence_tokens() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    batcher = Batcher(BatcherConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32), bm, 256)
    for request_id, length in (("a", 5), ("b", 10)):
        batcher.add(Sequence(request_id=request_id, prompt_token_ids=list(range(1, length + 1)),
                             sampling=SamplingParams()))
    assert batcher.num_running_context_tokens == 0  # both still waiting
    for _ in range(3):  # both prefill, then two decode steps: 5 + 10 prompt tokens + 3 sampled each
        plan = batcher.schedule()
        batcher.postprocess(plan, StepResult(sampled={c.request_id: SampledToken(7) for c in plan.chunks
                                                      if c.needs_sample}))
    assert batcher.num_running_context_tokens == 5 + 10 + 2 * 3


def test_running_remaining_counts_tokens_each_running_sequence_may_still_generate() -> None:
    bm = BlockManager(num_blocks=64, block_size=4)
    batcher = Batcher(BatcherConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32), bm, 256)
    for request_id, max_tokens in (("a", 10), ("b", 4)):
        batcher.add(Sequence(request_id=request_id, prompt_token_ids=[1, 2, 3],
                             sampling=SamplingParams(max_tokens=max_tokens)))
    assert batcher.num_running_remaining_tokens == 0  # both still waiting: no slot to free yet
    for _ in range(3):  # prefill, then two decode steps: 3 tokens out each
        plan = batcher.schedule()
        batcher.postprocess(plan, StepResult(sampled={c.request_id: SampledToken(7) for c in plan.chunks
                                                      if c.needs_sample}))
    assert batcher.num_running_remaining_tokens == (10 - 3) + (4 - 3)
