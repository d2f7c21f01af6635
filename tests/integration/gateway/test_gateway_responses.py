"""`POST /v1/responses` through the official openai SDK's `client.responses.create`, against the real
stack (tests/support/gateway_stack.py): text in and out, `instructions`, `store` with
`previous_response_id`, and the streamed `response.*` events in their documented order."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.support.gateway_stack import CONTEXT_WINDOW, MODEL, GatewayStack, Tenant

EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def test_text_in_text_out(client: OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert reply.id.startswith("resp_") and reply.object == "response"
    assert reply.output_text
    assert [(item.type, item.role) for item in reply.output] == [("message", "assistant")]  # type: ignore[union-attr]
    assert reply.usage is not None and 0 < reply.usage.output_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens


def test_max_output_tokens_cut_is_incomplete(client: OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Count from one to fifty.", max_output_tokens=3,
                                    temperature=0)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 3


def _chat(client: OpenAI, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=max_tokens, temperature=0)
    assert reply.usage is not None
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


def test_instructions_are_a_leading_system_message(client: OpenAI) -> None:
    """Greedy: the response is the chat completion of [system: instructions, user: input], token for token."""
    told = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in French.",
                                   max_output_tokens=6, temperature=0)
    text, prompt_tokens = _chat(client, [{"role": "system", "content": "Answer in French."},
                                         {"role": "user", "content": "Name a colour."}], 6)
    assert told.instructions == "Answer in French."
    assert told.usage is not None and told.usage.input_tokens == prompt_tokens
    assert told.output_text == text


def test_previous_response_id_continues_the_stored_history(client: OpenAI) -> None:
    """The second response's prompt is the first's input and output, then the new input."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    assert first.store is True
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # instructions are not carried over (as OpenAI documents): the history has no system turn
    text, prompt_tokens = _chat(client, [{"role": "user", "content": "My name is Ada."},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "What is my name?"}], 6)
    assert second.previous_response_id == first.id and second.id != first.id
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens
    assert second.output_text == text


def test_a_response_continues_its_whole_chain(client: OpenAI) -> None:
    """A stored response holds the whole history, so the third turn sees the first."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL, input="I live in Paris.", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    third = client.responses.create(model=MODEL, input="Who am I?", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    _, prompt_tokens = _chat(client, [{"role": "user", "content": "My name is Ada."},
                                      {"role": "assistant", "content": first.output_text},
                                      {"role": "user", "content": "I live in Paris."},
                                      {"role": "assistant", "content": second.output_text},
                                      {"role": "user", "content": "Who am I?"}], 4)
    assert third.usage is not None and third.usage.input_tokens == prompt_tokens


def test_unstored_response_cannot_be_continued(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    assert first.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=3)


def test_other_orgs_response_is_not_found(stack: GatewayStack, client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    with stack.openai(stack.tenant().key) as stranger, pytest.raises(openai.NotFoundError):
        stranger.responses.create(model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=3)


def test_malformed_previous_response_id_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_not-hex", max_output_tokens=3)
    assert refused.value.param == "previous_response_id"


def test_streamed_events_follow_the_documented_order(client: OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=60, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == EVENT_ORDER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    done = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.output_text
    assert events[0].response.id == done.id and done.status == "completed"  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.output_tokens > 0


def test_streamed_text_equals_the_unstreamed_text(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "input": "Name three animals.", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert events[-1].response.output_text == whole.output_text


def test_streamed_response_is_stored_and_continued(client: OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6,
                                          temperature=0, stream=True))
    first = events[-1].response  # type: ignore[union-attr]
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_streamed_length_cut_ends_with_response_incomplete(client: OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Count from one to fifty.", max_output_tokens=3,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


def test_list_input_with_developer_role(client: OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert reply.status in ("completed", "incomplete") and reply.output_text


def test_refused_request_stores_no_response(stack: GatewayStack, tenant: Tenant, client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):  # prompt + max_output_tokens over the context window
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=CONTEXT_WINDOW)
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with stack.http(tenant.key) as http:
        assert [c["title"] for c in http.get("/v1/conversations").json()["data"]] == ["response"]


WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


def test_a_stored_call_and_its_output_continue_as_the_same_chat_would(client: OpenAI) -> None:
    """The stored turns (a call spelled as the model reads it) give the continued response the prompt of
    the equivalent chat completion, token for token."""
    ask = "What is the weather in Paris?"
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                    temperature=0, max_output_tokens=60)
    call = next(item for item in first.output if item.type == "function_call")
    result = '{"temperature_c": 21}'
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none", temperature=0,  # type: ignore[list-item]
        max_output_tokens=8, input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],  # type: ignore[misc]
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},  # type: ignore[union-attr]
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}])  # type: ignore[union-attr]
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")
