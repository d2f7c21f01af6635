"""A decode stream that fell behind sends one message with the queued tokens, never past the end."""

from __future__ import annotations

from collections import deque

from engine.batch import TokenLogprobs
from engine.outputs import FinishReason, RequestOutput
from services.worker.decode_jobs import GenerateEvent, PrefillPath, coalesce


def _event(token: int, finish: FinishReason | None = None) -> GenerateEvent:
    lp = (TokenLogprobs(token, -0.5, ()),)
    return GenerateEvent(RequestOutput("r", (token,), f"t{token}", lp, finish, 9, 0))


def test_queued_outputs_merge_into_one_event_in_order() -> None:
    first = GenerateEvent(_event(1).output, PrefillPath.REMOTE)
    backlog: deque = deque([_event(2), _event(3, FinishReason.LENGTH)])
    merged = coalesce(first, backlog)
    out = merged.output
    assert (out.new_token_ids, out.new_text, [lp.token_id for lp in out.logprobs]) == ((1, 2, 3), "t1t2t3", [1, 2, 3])
    assert (out.finish_reason, out.num_prompt_tokens) == (FinishReason.LENGTH, 9)
    assert merged.prefill_path is PrefillPath.REMOTE
    assert not backlog


def test_an_error_or_the_end_marker_stays_for_the_caller() -> None:
    error = RuntimeError("engine failed")
    backlog: deque = deque([_event(2), error, _event(3)])
    assert coalesce(_event(1), backlog).output.new_token_ids == (1, 2)
    assert list(backlog)[0] is error
    backlog = deque([None])
    assert coalesce(_event(1), backlog).output.new_token_ids == (1,) and list(backlog) == [None]


def test_nothing_is_merged_after_a_finished_output() -> None:
    backlog: deque = deque([_event(2)])
    assert coalesce(_event(1, FinishReason.STOP), backlog).output.new_token_ids == (1,)
    assert len(backlog) == 1


def test_merging_keeps_the_tier_loaded_count_and_the_error_in_their_fields() -> None:
    first = GenerateEvent(RequestOutput("r", (1,), "t1", (), None, 9, 64, num_tier_loaded_tokens=48))
    last = GenerateEvent(RequestOutput("r", (2,), "t2", (), FinishReason.ABORT, 9, 0, error="engine failed"))
    out = coalesce(first, deque([last])).output
    assert (out.num_cached_tokens, out.num_tier_loaded_tokens, out.error) == (64, 48, "engine failed")
