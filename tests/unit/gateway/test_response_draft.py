"""`ResponseDraft`: a Responses API object folded from chat completion chunks, and how each finish maps
to its status (an aborted generation is a cancelled response)."""

from __future__ import annotations

from services.gateway.responses import ResponseDraft
from services.gateway.schemas import ResponsesRequest


def _chunk(text: str = "", finish: str | None = None, usage: dict[str, object] | None = None) -> dict[str, object]:
    choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}] if text or finish else []
    return {"id": "resp_x", "choices": choices, **({"usage": usage} if usage else {})}


def _draft() -> ResponseDraft:
    return ResponseDraft(ResponsesRequest(model="m", input="hi"), "resp_x", stored=False)


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}}


def test_chunks_fold_into_text_usage_and_a_cancelled_status_after_an_abort() -> None:
    draft = _draft()
    assert draft.absorb(_chunk("Hel")) == ("Hel", None)
    assert draft.absorb(_chunk("lo", "abort")) == ("lo", "abort")
    draft.absorb(_chunk(usage=USAGE))
    draft.finish("abort")
    body = draft.body()
    assert body["status"] == "cancelled" and body["output"][0]["content"][0]["text"] == "Hello"
    assert body["usage"]["output_tokens"] == 2 and body["usage"]["input_tokens_details"] == {"cached_tokens": 1}


def test_finish_reasons_map_to_statuses() -> None:
    for finish, status, reason in [("stop", "completed", None), ("length", "incomplete", "max_output_tokens"),
                                   ("content_filter", "incomplete", "content_filter"), ("abort", "cancelled", None)]:
        draft = _draft()
        draft.finish(finish)
        assert (draft.status, draft.incomplete) == (status, reason)


def test_an_error_chunk_fails_the_response_for_good() -> None:
    draft = _draft()
    assert draft.absorb({"error": {"message": "worker lost", "code": None}}) == ("", None)
    draft.finish("abort")
    assert draft.status == "failed" and draft.error == {"code": "server_error", "message": "worker lost"}
