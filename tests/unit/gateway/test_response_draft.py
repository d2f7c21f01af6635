"""`ResponseDraft`: a Responses API object folded from chat completion chunks, and how each finish maps
to its status (an aborted generation is a cancelled response)."""

from __future__ import annotations

from services.gateway.completions.response_draft import ResponseDraft
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


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = {"tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}


def test_a_call_only_answer_outputs_one_function_call_item_and_no_message() -> None:
    draft = ResponseDraft(ResponsesRequest.model_validate({"model": "m", "input": "hi", **TOOLS}), "resp_x",
                          stored=False)
    draft.absorb({"choices": [{"index": 0, "delta": {"content": None, "tool_calls": [CALL | {"index": 0}]},
                               "finish_reason": "tool_calls"}]})
    draft.finish("tool_calls")
    body = draft.body()
    assert body["status"] == "completed" and body["tools"][0]["name"] == "get_weather"
    assert body["output"] == [{"id": "fc_x_0", "type": "function_call", "call_id": "call_1", "name": "get_weather",
                               "arguments": '{"city": "Paris"}', "status": "completed"}]


def test_text_after_calls_comes_after_them_and_plain_text_is_one_message() -> None:
    draft = _draft()
    draft.absorb_message({"content": "<tool_call>\n{", "tool_calls": [CALL]})  # a cut second call
    assert [item["type"] for item in draft.output()] == ["function_call", "message"]
    assert (draft.call_index(0), draft.message_index()) == (0, 1)
    draft = _draft()
    draft.absorb_message({"content": "Hello", "tool_calls": None})
    assert [item["type"] for item in draft.output()] == ["message"]
    draft = _draft()
    draft.absorb_message({"content": None})  # nothing at all: still one (empty) message
    assert draft.output()[0]["content"][0]["text"] == ""


def test_input_items_become_chat_turns_and_tools_chat_tools() -> None:
    request = ResponsesRequest.model_validate({"model": "m", **TOOLS, "tool_choice": {"type": "function",
                                                                                      "name": "get_weather"},
        "input": [{"role": "user", "content": "Weather?"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "21C"}]})
    turns = request.input_messages()
    assert [t["role"] for t in turns] == ["user", "assistant", "tool"]
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["c1", "c2"] and turns[2]["tool_call_id"] == "c1"
    chat = request.chat_tools()
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"][0]["function"]["name"] == "get_weather" and chat["parallel_tool_calls"] is True


def test_turns_with_calls_are_stored_as_the_prompt_spells_them() -> None:
    from services.gateway.completions.responses import storable_turns
    from services.gateway.completions.tools import ToolFamily

    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    stored = storable_turns(turns, ToolFamily.HERMES)
    spelled = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert stored[1] == {"role": "assistant", "content": spelled}
    assert stored[2] == {"role": "user", "content": "<tool_response>\n21C\n</tool_response>"}
    assert storable_turns(stored, ToolFamily.HERMES) == stored  # read back and stored again: unchanged
    assert storable_turns(turns, ToolFamily.LLAMA3)[2] == {"role": "tool", "content": "21C"}
