"""Request bodies are validated strictly: a value of the wrong JSON type is a 400 naming its field (never
coerced: `max_tokens: true` is not 1), a field of several forms is named as itself, and the bodies the
official OpenAI SDK sends still pass."""

from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError

from services.gateway.errors import validation_message
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, ConversationCreate, ResponsesRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}
RESPONSE = {"model": "m", "input": "hi"}


def _refused(model: type, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_message(e.value)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", True), ("max_tokens", "16"), ("max_tokens", 16.0), ("stream", "yes"), ("stream", 1),
    ("temperature", "0.5"), ("temperature", True), ("n", True), ("seed", "7"), ("logprobs", 1), ("top_logprobs", False),
    ("ignore_eos", "true"), ("parallel_tool_calls", 0), ("presence_penalty", "1"),
])
def test_chat_fields_of_the_wrong_type_are_refused_naming_the_field(field: str, value: object) -> None:
    message, param = _refused(ChatCompletionRequest, CHAT | {field: value})
    assert param == field and message.startswith(f"{field}: ")


@pytest.mark.parametrize(("field", "value"), [
    ("prompt", [True]), ("prompt", True), ("prompt", [[1, True]]), ("prompt", [1.5]), ("echo", 1),
    ("logprobs", True), ("max_tokens", True),
])
def test_completion_fields_of_the_wrong_type_are_refused_naming_the_field(field: str, value: object) -> None:
    assert _refused(CompletionRequest, TEXT | {field: value})[1] == field


@pytest.mark.parametrize(("field", "value"), [
    ("max_output_tokens", True), ("stream", "yes"), ("store", "false"), ("temperature", "1"),
])
def test_responses_fields_of_the_wrong_type_are_refused_naming_the_field(field: str, value: object) -> None:
    assert _refused(ResponsesRequest, RESPONSE | {field: value})[1] == field


def test_a_field_of_several_forms_is_named_as_itself_with_each_forms_reason() -> None:
    message, param = _refused(CompletionRequest, TEXT | {"prompt": [True]})
    assert param == "prompt"
    assert "as list[int].0: Input should be a valid integer" in message and "as str:" in message
    message, param = _refused(ChatCompletionRequest, CHAT | {"messages": [{"role": "user", "content": 5}]})
    assert param == "messages.0.content"


def test_a_conversation_body_is_strict_too() -> None:
    assert _refused(ConversationCreate, {"title": 5})[1] == "title"


def test_what_the_openai_sdk_sends_still_passes() -> None:
    """Integers where numbers are expected, ids as strings, every optional field the SDK may send."""
    conversation = uuid.uuid4()
    chat = ChatCompletionRequest.model_validate(CHAT | {
        "temperature": 0, "top_p": 1, "max_completion_tokens": 16, "n": 2, "seed": 3, "stop": ["\n"],
        "presence_penalty": 0, "frequency_penalty": 0.5, "stream": True, "stream_options": {"include_usage": True},
        "logprobs": True, "top_logprobs": 2, "user": "u", "logit_bias": {"50256": -100}, "metadata": {"a": "b"},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                   "strict": True}},
        "conversation_id": str(conversation), "ignore_eos": True, "speculative": {"num_draft_tokens": 4},
        "messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                     {"role": "user", "content": "hi", "name": "ada"}]})
    assert chat.temperature == 0.0 and isinstance(chat.temperature, float)
    assert chat.conversation_id == conversation and chat.ignore_eos and chat.requested_max_tokens() == 16
    text = CompletionRequest.model_validate(TEXT | {"prompt": [[1, 2], [3]], "logprobs": 2, "echo": True,
                                                    "best_of": 1, "max_tokens": 8, "temperature": 1})
    assert text.prompts() == [[1, 2], [3]]
    response = ResponsesRequest.model_validate(RESPONSE | {"max_output_tokens": 8, "temperature": 1, "top_p": 1,
                                                           "store": False, "metadata": {"k": "v"}})
    assert response.max_output_tokens == 8


def test_vllm_sampling_extensions_reach_the_worker_request() -> None:
    from services.gateway.completions.generation import SamplingSpec

    body = ChatCompletionRequest.model_validate(CHAT | {"ignore_eos": True, "top_k": -1, "min_p": 0.1,
                                                        "repetition_penalty": 1.2, "stop_token_ids": [2, 7]})
    assert (body.top_k, body.min_p, body.repetition_penalty, body.stop_token_ids) == (-1, 0.1, 1.2, [2, 7])
    proto = SamplingSpec(8, ignore_eos=True, top_k=5, min_p=0.1, repetition_penalty=1.2,
                         stop_token_ids=(2, 7)).to_proto()
    assert proto.ignore_eos and proto.top_k == 5 and list(proto.stop_token_ids) == [2, 7]
    assert abs(proto.min_p - 0.1) < 1e-6 and abs(proto.repetition_penalty - 1.2) < 1e-6
    for bad in ({"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0}, {"stop_token_ids": [-1]},
                {"stop_token_ids": ["2"]}):
        assert _refused(ChatCompletionRequest, CHAT | bad)[1].startswith(next(iter(bad)))  # type: ignore[union-attr]
