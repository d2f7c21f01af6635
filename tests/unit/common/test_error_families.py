"""ConfigError and InvalidRequestError are one class each, caught by both the engine's and the services' roots.

The engine and the services both raise them; a worker edge catches `EngineError`, the HTTP and gRPC edges
catch `BatonError` and render its status, code and param."""

from __future__ import annotations

import json

import grpc
import pytest

from engine import errors as engine_errors
from services.common import errors as service_errors
from services.gateway.errors import BadRequestError, ContextWindowError, baton_error_response
from services.gateway.grpc_api.status import failure_of
from tokenization.chat_template import ChatTemplate


def _render(exc: Exception) -> tuple[int, dict]:
    response = baton_error_response(exc)  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body))


@pytest.mark.parametrize("name", ["ConfigError", "InvalidRequestError"])
def test_the_engine_and_the_services_name_the_same_class(name: str) -> None:
    assert getattr(engine_errors, name) is getattr(service_errors, name)


@pytest.mark.parametrize("error", [engine_errors.ConfigError("bad dtype 'x'; valid: float32, bfloat16"),
                                   engine_errors.InvalidRequestError("empty prompt")])
def test_both_roots_catch_either_error(error: Exception) -> None:
    with pytest.raises(engine_errors.EngineError):
        raise error
    with pytest.raises(service_errors.BatonError):
        raise error


def test_an_engine_config_error_renders_as_a_500_config_error_with_its_message() -> None:
    status, body = _render(engine_errors.ConfigError("bad dtype 'x'; valid: float32, bfloat16"))
    assert status == 500
    assert body["error"]["code"] == "config_error"
    assert body["error"]["message"] == "bad dtype 'x'; valid: float32, bfloat16"


def test_a_chat_template_rejection_is_a_400_naming_messages_over_http_and_grpc() -> None:
    template = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(service_errors.InvalidRequestError) as refused:
        template.render([{"role": "system", "content": "x"}], add_generation_prompt=True, tools=None, variables={})
    status, body = _render(refused.value)
    assert status == 400
    assert body["error"] == {"message": "chat template rejected the messages: only user turns",
                             "type": "invalid_request_error", "param": "messages", "code": "invalid_request_error"}
    failure = failure_of(refused.value)
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ("baton-error-param", "messages") in failure.metadata


def test_gateway_bad_requests_keep_their_own_param_and_code() -> None:
    status, body = _render(ContextWindowError(2048, 2000, 100))
    assert status == 400 and body["error"]["param"] == "messages"
    assert body["error"]["code"] == "context_length_exceeded"
    status, body = _render(BadRequestError("n must be >= 1", param="n"))
    assert status == 400 and body["error"]["param"] == "n" and body["error"]["code"] == "invalid_request_error"
