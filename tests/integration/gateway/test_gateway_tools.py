"""Tool calling and structured outputs through the official openai SDK, against the real worker
(the default 135M model: its calls and JSON are valid because the grammar allows nothing else)."""

from __future__ import annotations

import json

import jsonschema
from openai import OpenAI

from tests.support.gateway_stack import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_call(call: object, tools: list[dict]) -> None:
    fn = call.function  # type: ignore[attr-defined]
    spec = next(t["function"] for t in tools if t["function"]["name"] == fn.name)
    jsonschema.validate(json.loads(fn.arguments), spec["parameters"])
    assert call.id.startswith("call_") and call.type == "function"  # type: ignore[attr-defined]


def test_required_tool_choice_returns_a_valid_call(client: OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required", temperature=0, max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _valid_call(call, [WEATHER, TIME])


def test_named_tool_choice_calls_that_function_once(client: OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80)
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_time"]
    _valid_call(calls[0], [TIME])


def test_streamed_tool_call_deltas_assemble_into_the_same_call(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
              "temperature": 0, "max_tokens": 80}
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    names, args, finish = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                names[d.index] = names.get(d.index, "") + (d.function.name or "")
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    expected = whole.choices[0].message.tool_calls or []
    assert [names[i] for i in sorted(names)] == [c.function.name for c in expected]
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.function.arguments) for c in expected]


def test_tool_results_in_history_are_accepted(client: OpenAI) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=12)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_unknown_named_tool_is_a_400(client: OpenAI) -> None:
    import openai
    try:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    except openai.BadRequestError as e:
        assert "tool_choice" in str(e)
    else:
        raise AssertionError("expected a 400")


def test_json_schema_response_format_validates(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_json_object_response_format_streams_an_object(client: OpenAI) -> None:
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List two fruits as JSON."}], temperature=0,
        max_tokens=60, response_format={"type": "json_object"}, stream=True) if c.choices)
    assert isinstance(json.loads(text), dict)
