"""gRPC requests -> the HTTP API's validated request bodies, so both edges share one set of rules.

The body is validated by the same pydantic models as `POST /v1/chat/completions` and
`POST /v1/completions`; a failure is a `BadRequestError` naming the field as the proto spells it
(`sampling.temperature`). Every call streams, with usage at the end.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import ValidationError

from rpcgen.baton.v1 import api_pb2 as pb
from services.gateway.errors import BadRequestError, validation_message
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "stop",
                    "n", "logprobs", "top_logprobs")
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "seed")
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


def chat_body(request: pb.ChatRequest) -> ChatCompletionRequest:
    body = _common(request.model, request.sampling, request.user)
    body["messages"] = [_message(m) for m in request.messages]
    if request.sampling.HasField("logprobs"):
        body |= {"logprobs": True, "top_logprobs": request.sampling.logprobs}
    if request.conversation_id:
        body["conversation_id"] = request.conversation_id
    return _validated(ChatCompletionRequest, body)


def text_body(request: pb.CompleteRequest) -> CompletionRequest:
    body = _common(request.model, request.sampling, request.user)
    body |= {"prompt": request.prompt, "echo": request.echo}
    if request.sampling.HasField("logprobs"):
        body["logprobs"] = request.sampling.logprobs
    return _validated(CompletionRequest, body)


def _common(model: str, sampling: pb.SamplingOptions, user: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "n": sampling.n or 1, "presence_penalty": sampling.presence_penalty,
                            "frequency_penalty": sampling.frequency_penalty}
    body |= {name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING if sampling.HasField(name)}
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if user:
        body["user"] = user
    return body


def _message(message: pb.ChatMessage) -> dict[str, str]:
    fields = {"role": message.role, "content": message.content, "name": message.name,
              "tool_call_id": message.tool_call_id}
    return {k: v for k, v in fields.items() if v or k == "content"}


def _validated(model: type[Body], body: dict[str, Any]) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        if param is None:
            raise BadRequestError(message) from e
        named = proto_param(param)
        raise BadRequestError(named + message.removeprefix(param), named) from e


def proto_param(param: str) -> str:
    """The HTTP API's field name as the proto spells it: `temperature` -> `sampling.temperature`."""
    head, dot, rest = param.partition(".")
    if head not in _SAMPLING_FIELDS:
        return param
    return "sampling." + ("logprobs" if head == "top_logprobs" else head) + dot + rest
