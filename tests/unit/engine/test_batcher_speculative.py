"""The batcher with speculative drafts: scheduling (caps, budget, blocks), and what postprocess keeps
when the runner accepts only part of a draft (computed tokens, outputs, prefix-cache hashes)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest
from batcher_helpers import BS, free_blocks, held, make, shape

from engine.batch import BatchPlan, SampledToken, StepResult
from engine.batcher import Batcher
from engine.block_manager import BlockManager, KVEventKind
from engine.config import BatcherConfig
from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import DraftProposer
from tokenization.block_hashes import block_hashes

DRAFT = (51, 52, 53, 54)
CORRECTION = 99


class FixedDraft(DraftProposer):
    """Proposes DRAFT (cut to k) for every sequence; records forgotten requests."""

    def __init__(self, draft: tuple[int, ...] = DRAFT) -> None:
        self.draft = draft
        self.forgotten: list[str] = []

    def propose(self, request_id: str, token_ids: Seq[int], k: int) -> tuple[int, ...]:
        return self.draft[:k]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def spec_batcher(num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 8,
                 max_model_len: int = 64, proposer: DraftProposer | None = None) -> Batcher:
    return Batcher(BatcherConfig(max_num_seqs, budget, 16), BlockManager(num_blocks, BS, True), max_model_len,
                   proposer or FixedDraft())


def spec_seq(rid: str, n: int, k: int = 4, max_tokens: int = 32, start: int = 100) -> Sequence:
    return Sequence(rid, list(range(start, start + n)),
                    SamplingParams(max_tokens=max_tokens, num_draft_tokens=k))


def accept(plan: BatchPlan, n: int) -> StepResult:
    """The runner's answer when each chunk's first `n` draft tokens are accepted, then CORRECTION."""
    sampled, accepted = {}, {}
    for c in plan.chunks:
        if c.needs_sample:
            accepted[c.request_id] = tuple(SampledToken(t) for t in c.draft_token_ids[:n])
            sampled[c.request_id] = SampledToken(CORRECTION)
    return StepResult(sampled, accepted)


def prefill(b: Batcher) -> None:
    plan = b.schedule()
    assert all(c.num_draft_tokens == 0 for c in plan.chunks)  # prompts never draft
    b.postprocess(plan, accept(plan, 0))


def test_a_decode_carries_its_pending_token_then_the_draft() -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 6))
    prefill(b)
    (chunk,) = b.schedule().chunks
    assert chunk.token_ids == (CORRECTION, *DRAFT) and chunk.num_draft_tokens == 4
    assert chunk.draft_token_ids == DRAFT and chunk.start_pos == 6 and chunk.needs_sample
    assert len(chunk.block_ids) * BS >= chunk.context_len == 11


@pytest.mark.parametrize("n_accepted", [0, 2, 4])
def test_only_accepted_drafts_count_as_computed_and_appended(n_accepted: int) -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 6))
    prefill(b)
    plan = b.schedule()
    (got,) = b.postprocess(plan, accept(plan, n_accepted))
    assert got.output_token_ids == [CORRECTION, *DRAFT[:n_accepted], CORRECTION]
    assert got.num_computed_tokens == 7 + n_accepted == got.num_tokens - 1
    (nxt,) = b.schedule().chunks
    assert nxt.start_pos == 7 + n_accepted  # the first rejected slot is overwritten


def test_rejected_draft_slots_never_enter_the_prefix_cache() -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 3))  # prompt 3 + first token: the draft fills block 0 and spills into block 1
    prefill(b)
    b.block_manager.drain_events()
    plan = b.schedule()
    b.postprocess(plan, accept(plan, 0))
    s = held(b, "a")
    assert s.num_computed_tokens == 4
    stored = [e.block_hash for e in b.block_manager.drain_events() if e.kind is KVEventKind.STORED]
    assert stored == block_hashes(s.all_token_ids[:4], BS)  # the real tokens, not prompt + draft
    for _ in range(3):
        plan = b.schedule()
        b.postprocess(plan, accept(plan, 1))
    stored += [e.block_hash for e in b.block_manager.drain_events() if e.kind is KVEventKind.STORED]
    assert stored == block_hashes(s.all_token_ids[:s.num_computed_tokens], BS)


def test_draft_never_runs_past_max_tokens() -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 6, k=4, max_tokens=3))
    prefill(b)  # 1 output: at most 2 more, so a draft of 1 plus the model's own token
    (chunk,) = b.schedule().chunks
    assert chunk.num_draft_tokens == 1


def test_draft_never_runs_past_the_length_limit() -> None:
    b = spec_batcher(max_model_len=10)
    b.add(spec_seq("a", 7, k=4))
    prefill(b)  # 8 tokens of at most 10
    (chunk,) = b.schedule().chunks
    assert chunk.num_draft_tokens == 1


def test_drafts_leave_every_later_decode_one_token_of_budget() -> None:
    b = spec_batcher(budget=8, max_num_seqs=4)
    for i, rid in enumerate("abc"):
        b.add(spec_seq(rid, 2, start=100 * (i + 1)))
    prefill(b)
    plan = b.schedule()
    assert [c.num_draft_tokens for c in plan.chunks] == [4, 1, 0]
    assert plan.num_tokens == 8


def test_a_draft_is_dropped_rather_than_preempting() -> None:
    b = spec_batcher(num_blocks=4)
    b.add(spec_seq("a", 7))
    b.add(spec_seq("b", 7, start=300))
    prefill(b)  # each holds 2 blocks (7 tokens + 1 slot); none free
    assert free_blocks(b) == 0
    plan = b.schedule()
    assert shape(plan) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert plan.preempted == ()


def test_a_draft_does_not_take_the_block_a_later_decode_needs() -> None:
    b = spec_batcher(num_blocks=6)
    b.add(spec_seq("a", 7, k=0))
    b.add(spec_seq("b", 7, k=0, start=300))
    prefill(b)
    plan = b.schedule()
    b.postprocess(plan, accept(plan, 0))  # 9 tokens each in 2 blocks: each decode needs 1 of the 2 free
    held(b, "a").sampling = SamplingParams(max_tokens=32, num_draft_tokens=4)
    plan = b.schedule()  # a's draft would need both free blocks; b's decode needs one of them
    assert shape(plan) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert plan.preempted == ()


def test_runner_accepting_tokens_outside_the_draft_is_an_engine_error() -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 6))
    prefill(b)
    plan = b.schedule()
    bad = StepResult({"a": SampledToken(1)}, {"a": (SampledToken(DRAFT[1]),)})
    with pytest.raises(EngineError):
        b.postprocess(plan, bad)


def test_finish_makes_the_proposer_forget_the_request() -> None:
    proposer = FixedDraft()
    b = spec_batcher(proposer=proposer)
    b.add(spec_seq("a", 6))
    prefill(b)
    b.abort("a")
    assert proposer.forgotten == ["a"]


def test_requests_without_drafts_decode_one_token() -> None:
    b = spec_batcher()
    b.add(spec_seq("a", 6, k=0))
    prefill(b)
    assert shape(b.schedule()) == [("a", 6, 1, True)]


def test_a_batcher_without_a_proposer_never_drafts() -> None:
    b = make()
    b.add(spec_seq("a", 6))
    prefill(b)
    assert b.schedule().chunks[0].num_draft_tokens == 0
