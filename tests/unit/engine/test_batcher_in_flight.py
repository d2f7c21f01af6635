"""Batches in flight (an overlapped pipeline): the batcher plans a second step before the first is
postprocessed, and a sequence is in at most one plan in flight."""

from __future__ import annotations

import pytest
from batcher_helpers import TOKEN, free_blocks, held, make, run, seq

from engine.errors import EngineError
from engine.outputs import FinishReason
from engine.sequence import SequenceStatus


def ids(plan) -> set[str]:  # noqa: ANN001
    return {c.request_id for c in plan.chunks}


def test_a_second_plan_skips_the_sequences_of_the_plan_in_flight() -> None:
    b = make(budget=8, chunk=8)
    for i, n in enumerate((6, 6, 3)):
        b.add(seq(f"s{i}", n, start=100 * (i + 1)))
    first = b.schedule()  # s0 and the first 2 tokens of s1 fill the budget
    second = b.schedule()  # the rest of s1 is in flight: only s2 may come
    assert ids(first) == {"s0", "s1"} and ids(second) == {"s2"}
    assert b.in_flight_request_ids() == [("s0", "s1"), ("s2",)]
    third = b.schedule()
    assert third.is_empty  # every running sequence is in flight
    b.postprocess(first, run(first))
    assert ids(b.schedule()) == {"s0", "s1"}  # s0's token is back: its decode; s1's next chunk
    assert b.num_in_flight == 2


def test_plans_are_postprocessed_in_the_order_they_were_scheduled() -> None:
    b = make()
    b.add(seq("a", 3))
    b.add(seq("b", 3, start=300))
    first = b.schedule()
    b.add(seq("c", 3, start=500))
    second = b.schedule()
    with pytest.raises(EngineError, match="not the oldest in flight"):
        b.postprocess(second, run(second))
    b.postprocess(first, run(first))
    b.postprocess(second, run(second))
    assert [held(b, r).output_token_ids for r in "abc"] == [[TOKEN]] * 3


def test_a_sequence_aborted_in_flight_is_skipped_and_its_blocks_free_at_once() -> None:
    b = make(num_blocks=8)
    b.add(seq("a", 5))
    plan = b.schedule()
    assert b.abort("a")
    assert free_blocks(b) == 8
    assert b.postprocess(plan, run(plan)) == [] and b.num_in_flight == 0


def test_a_new_sequence_reusing_an_aborted_id_is_not_held_back_by_the_old_plan() -> None:
    b = make()
    b.add(seq("a", 5))
    old = b.schedule()
    b.abort("a")
    b.add(seq("a", 4, start=300))
    assert ids(b.schedule()) == {"a"}  # the in-flight plan holds the old sequence, not this one
    assert b.postprocess(old, run(old)) == []


def test_preemption_never_picks_a_sequence_in_flight() -> None:
    b = make(num_blocks=4, budget=16, chunk=16, max_model_len=16)  # 4 blocks of 4 tokens
    b.add(seq("a", 3))  # one block: 3 prompt tokens and its first token
    first = b.schedule()
    b.postprocess(first, run(first))
    decode = b.schedule()  # a's token at position 3, the last slot of its block
    b.add(seq("b", 11, start=300))
    prefill = b.schedule()  # a is in flight: b alone, taking the 3 free blocks
    assert ids(decode) == {"a"} and ids(prefill) == {"b"} and free_blocks(b) == 0
    b.postprocess(decode, run(decode))
    # a's next token needs a block; b is newer but in flight, so a gives way, not b.
    plan = b.schedule()
    assert plan.preempted == ("a",) and plan.is_empty
    assert held(b, "a").status is SequenceStatus.PREEMPTED
    assert held(b, "b").status is SequenceStatus.RUNNING and len(held(b, "b").block_ids) == 3
    b.postprocess(prefill, run(prefill))
    assert held(b, "b").output_token_ids == [TOKEN]


def test_drop_in_flight_makes_a_failed_steps_sequences_schedulable_again() -> None:
    b = make()
    b.add(seq("a", 5))
    first = b.schedule()
    b.drop_in_flight()
    again = b.schedule()
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in again.chunks] == \
        [(c.request_id, c.start_pos, c.num_tokens) for c in first.chunks]
    b.postprocess(again, run(again))
    b.finish("a", FinishReason.STOP)
    assert free_blocks(b) == 32


def test_a_dropped_plan_that_leaves_the_pipeline_later_is_known_once_and_never_postprocessed() -> None:
    b = make(pipeline_depth=2)
    b.add(seq("a", 5))
    dropped = b.schedule()
    b.drop_in_flight()
    again = b.schedule()  # a is planned again while the dropped plan may still be in the pipeline
    assert b.discard_dropped(dropped) and not b.discard_dropped(dropped)
    assert not b.discard_dropped(again)
    with pytest.raises(EngineError, match="not the oldest in flight"):
        b.postprocess(dropped, run(dropped))
    b.postprocess(again, run(again))
    assert held(b, "a").output_token_ids == [TOKEN]


def test_with_a_depth_of_two_a_plan_takes_half_the_sequences_that_could_run() -> None:
    b = make(pipeline_depth=2)
    for i in range(5):
        b.add(seq(f"s{i}", 2, start=100 * (i + 1)))
    first, second, third = b.schedule(), b.schedule(), b.schedule()
    assert [len(p.chunks) for p in (first, second, third)] == [3, 2, 0]  # ceil(5 / 2), the rest, all in flight
    b.postprocess(first, run(first))
    assert ids(b.schedule()) == ids(first)
