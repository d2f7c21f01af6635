"""Errors leave in OpenAI's JSON shape with the right status; bad input never reaches a worker."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.support.gateway_stack import CONTEXT_WINDOW, MODEL, GatewayStack, Tenant

MESSAGES = [{"role": "user", "content": "Hello"}]


def _error(response_json: dict) -> dict:
    error = response_json["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_an_unknown_key_is_401(stack: GatewayStack) -> None:
    bad = stack.openai("bt-" + "A" * 43)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert e.value.status_code == 401
    assert _error(e.value.response.json())["code"] == "invalid_api_key"


def test_a_missing_key_is_401(stack: GatewayStack) -> None:
    with stack.http() as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401 and _error(r.json())["code"] == "invalid_api_key"


def test_an_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=1)
    error = _error(e.value.response.json())
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_an_overlong_prompt_is_400_naming_the_limit_and_the_count(stack: GatewayStack, client: OpenAI) -> None:
    before = stack.worker_status()
    huge = [{"role": "user", "content": "word " * (CONTEXT_WINDOW + 100)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=huge, max_tokens=10)
    error = _error(e.value.response.json())
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"maximum context length is {CONTEXT_WINDOW} tokens" in error["message"]
    requested = int(error["message"].split("you requested ")[1].split(" tokens")[0])
    assert requested > CONTEXT_WINDOW
    after = stack.worker_status()
    assert after.free_blocks == before.free_blocks and after.running_seqs == 0  # no GPU work at all


def test_max_tokens_beyond_the_window_is_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=CONTEXT_WINDOW + 1)
    assert f"maximum context length is {CONTEXT_WINDOW}" in _error(e.value.response.json())["message"]


@pytest.mark.parametrize(("field", "value"), [("temperature", 5), ("top_p", 0), ("n", 0), ("max_tokens", 0),
                                              ("presence_penalty", 3), ("stop", ["a", "b", "c", "d", "e"])])
def test_out_of_range_parameters_are_400_naming_the_parameter(stack: GatewayStack, tenant: Tenant, field: str,
                                                              value: object) -> None:
    with stack.http(tenant.key) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, field: value})
    assert r.status_code == 400
    error = _error(r.json())
    assert error["type"] == "invalid_request_error" and error["param"].startswith(field)


def test_malformed_json_is_400(stack: GatewayStack, tenant: Tenant) -> None:
    with stack.http(tenant.key) as http:
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and _error(r.json())["type"] == "invalid_request_error"


def test_an_unknown_route_is_404_json(stack: GatewayStack, tenant: Tenant) -> None:
    with stack.http(tenant.key) as http:
        r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and _error(r.json())["code"] == "not_found"


def test_models_lists_the_context_window_and_price(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].model_extra or {}
    assert extra["context_window"] == CONTEXT_WINDOW
    assert set(extra["pricing"]) >= {"input", "cached_input", "output"}
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
