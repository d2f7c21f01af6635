"""`BATON_AUTH_MODE=none`: a gateway with no Postgres, Redis or Kafka in front of a real `both` worker.

The environment given to the gateway names no database, Redis or broker at all: the gateway must
start, serve completions (streamed and not) and models without an API key, and refuse conversations
and usage with 501 `feature_disabled`. What benchmark tools need of it is checked here too (vLLM's
`/health`, `/ping`, `/version`, `ignore_eos`), with edges of the HTTP layer: the header cap, strict
types, schemas that admit nothing, tool calls cut by max_tokens.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from services.launcher.supervisor import Supervisor
from tests.support.gateway_stack import MODEL, open_gateway_env, start_gateway, start_worker

MAX_HEADER_BYTES = 8192

ROOT = Path(__file__).resolve().parents[3]
_INFRA_VARS = ("BATON_DATABASE_URL", "BATON_REDIS_URL", "BATON_KAFKA_BOOTSTRAP")


@pytest.fixture(scope="module")
def open_gateway(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path,
                 monkeypatch_module: pytest.MonkeyPatch) -> Iterator[str]:
    for name in _INFRA_VARS:  # children inherit the environment: make sure none of it leaks in
        monkeypatch_module.delenv(name, raising=False)
    supervisor = Supervisor(tmp_path_factory.mktemp("open-gateway-logs"), cwd=ROOT)
    try:
        worker = start_worker(supervisor, "worker-both", "both", default_model_dir)
        _, url = start_gateway(supervisor, "gateway",
                               open_gateway_env(worker, default_model_dir, BATON_SSE_KEEPALIVE_S="0.1",
                                                BATON_MAX_HEADER_BYTES=str(MAX_HEADER_BYTES)))
        yield url
        assert "BATON_AUTH_MODE=none" in supervisor.log_tail("gateway", 200)  # the loud warning
    finally:
        supervisor.stop_all()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture
def client(open_gateway: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{open_gateway}/v1", api_key="ignored-in-open-mode", max_retries=0, timeout=60) as c:
        yield c


def test_streamed_completion_needs_no_key(client: OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_request_without_authorization_header_is_served(open_gateway: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    reply = httpx.post(f"{open_gateway}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] <= 3
    assert not any(h.startswith("x-ratelimit-") for h in reply.headers)


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/conversations"), ("POST", "/v1/conversations"),
                                              ("GET", "/v1/usage?start=2025-01-01")])
def test_storage_endpoints_answer_feature_disabled(open_gateway: str, method: str, path: str) -> None:
    reply = httpx.request(method, f"{open_gateway}{path}", json={"title": "t"} if method == "POST" else None,
                          timeout=10)
    assert reply.status_code == 501
    assert reply.headers["x-should-retry"] == "false"
    error = reply.json()["error"]
    assert error["code"] == "feature_disabled"
    assert "auth_mode=none" in error["message"]


def test_continuing_a_conversation_is_refused_before_any_work(open_gateway: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "conversation_id": "00000000-0000-0000-0000-000000000001"}
    reply = httpx.post(f"{open_gateway}/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 501
    assert reply.json()["error"]["code"] == "feature_disabled"


def test_readiness_checks_only_the_worker(open_gateway: str) -> None:
    reply = httpx.get(f"{open_gateway}/readyz", timeout=10)
    assert reply.status_code == 200
    assert reply.json()["checks"] == {"worker": "ok"}


def test_responses_are_served_but_not_stored(client: OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, temperature=0)
    assert reply.output_text and reply.store is False
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, temperature=0,
                                          stream=True))
    assert events[-1].response.output_text == reply.output_text  # type: ignore[union-attr]
    assert events[-1].response.store is False  # type: ignore[union-attr]


def test_previous_response_id_is_feature_disabled(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model=MODEL, input="Again", previous_response_id=first.id, max_output_tokens=3)
    assert refused.value.status_code == 501
    assert refused.value.code == "feature_disabled"


def test_ignore_eos_runs_to_max_tokens_and_stop_strings_still_stop(client: OpenAI) -> None:
    """vLLM's semantics: only the end-of-sequence token is ignored."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 32,
           "temperature": 0}
    plain = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 32
    ignoring = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 32
    assert ignoring.choices[0].message.content.startswith(plain.choices[0].message.content)
    stop = plain.choices[0].message.content.split()[-1]
    stopped = client.chat.completions.create(**ask, stop=[stop], extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 32


def test_vllm_liveness_and_version_probes_answer(open_gateway: str) -> None:
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        reply = httpx.request(method, f"{open_gateway}{path}", timeout=10)
        assert (reply.status_code, reply.content) == (200, b""), path
    assert isinstance(httpx.get(f"{open_gateway}/version", timeout=10).json()["version"], str)


def test_health_is_503_when_no_worker_answers(tmp_path: Path, default_model_dir: Path) -> None:
    from services.launcher.process import free_port
    from services.launcher.supervisor import ChildSpec, http_ok

    supervisor = Supervisor(tmp_path, cwd=ROOT)
    port = free_port()
    env = open_gateway_env(f"127.0.0.1:{free_port()}", default_model_dir)  # nothing listens there
    try:
        supervisor.start(ChildSpec("gateway", [sys.executable, "-m", "services.gateway", "--port", str(port)],
                                   http_ok(f"http://127.0.0.1:{port}/healthz"), env=env, ready_timeout_s=60))
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=10).status_code == 503
    finally:
        supervisor.stop_all()


def test_a_request_head_over_the_configured_cap_is_431(open_gateway: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    big = httpx.post(f"{open_gateway}/v1/completions", json=body, headers={"x-big": "a" * MAX_HEADER_BYTES},
                     timeout=10)
    assert big.status_code == 431 and big.json()["error"]["code"] == "request_header_fields_too_large"
    fits = httpx.post(f"{open_gateway}/v1/completions", json=body, headers={"x-big": "a" * (MAX_HEADER_BYTES // 2)},
                      timeout=60)
    assert fits.status_code == 200


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "max_tokens", True), ("/v1/chat/completions", "stream", "yes"),
    ("/v1/chat/completions", "ignore_eos", 1), ("/v1/completions", "prompt", [True]),
    ("/v1/completions", "max_tokens", "4"), ("/v1/responses", "max_output_tokens", True),
])
def test_values_of_the_wrong_type_are_400_naming_the_field(open_gateway: str, path: str, field: str,
                                                           value: object) -> None:
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
              "/v1/completions": {"prompt": "Hi"}, "/v1/responses": {"input": "Hi"}}
    reply = httpx.post(f"{open_gateway}{path}", json={"model": MODEL, **bodies[path], field: value}, timeout=10)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)


def test_a_schema_that_admits_no_document_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}})
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    assert "admits no output" in refused.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("seed", [20, 27])  # seeds whose answer starts a call that max_tokens cuts
def test_a_reply_cut_by_max_tokens_with_tools_returns_what_was_billed(client: OpenAI, seed: int) -> None:
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, tools=[weather],  # type: ignore[arg-type, list-item]
                                           max_tokens=24, seed=seed)
    choice = reply.choices[0]
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert choice.message.content or choice.message.tool_calls  # never 24 tokens billed for nothing
    if not choice.message.tool_calls:
        assert choice.finish_reason == "length"


RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                    "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris?"


def test_responses_call_tools_as_chat_completions_do(client: OpenAI) -> None:
    kwargs = {"model": MODEL, "input": ASK_WEATHER, "tools": [RESPONSES_WEATHER], "tool_choice": "required",
              "temperature": 0, "max_output_tokens": 60}
    reply = client.responses.create(**kwargs)  # type: ignore[call-overload]
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and reply.status == "completed"
    assert isinstance(json.loads(calls[0].arguments)["city"], str) and calls[0].call_id.startswith("call_")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK_WEATHER}], temperature=0, max_tokens=60,
        tools=[{"type": "function", "function": {k: v for k, v in RESPONSES_WEATHER.items() if k != "type"}}],
        tool_choice="required")
    assert json.loads(calls[0].arguments) == json.loads(chat.choices[0].message.tool_calls[0].function.arguments)
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].arguments == calls[0].arguments  # type: ignore[union-attr]


def test_responses_take_function_call_outputs_as_input(client: OpenAI) -> None:
    reply = client.responses.create(model=MODEL, tools=[RESPONSES_WEATHER], tool_choice="none", temperature=0,  # type: ignore[list-item]
                                    max_output_tokens=12, input=[
        {"role": "user", "content": ASK_WEATHER},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c": 21}'}])
    assert reply.output_text and [item.type for item in reply.output] == ["message"]


def test_responses_refuse_tools_they_cannot_run(open_gateway: str) -> None:
    reply = httpx.post(f"{open_gateway}/v1/responses", timeout=10, json={
        "model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith("tools.0")


def test_vllm_top_k_and_stop_token_ids_are_honoured(client: OpenAI, default_model_dir: Path) -> None:
    """top_k 1 samples the greedy answer whatever the temperature; a stop token id ends it where it first
    appears (the engine had both; the gateway used to drop them)."""
    from tokenization.tokenizer import Tokenizer

    ask = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12}
    greedy = client.completions.create(**ask, temperature=0, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    top1 = client.completions.create(**ask, temperature=1.5, seed=7,  # type: ignore[call-overload]
                                     extra_body={"ignore_eos": True, "top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    ids = Tokenizer.from_dir(default_model_dir).encode(greedy.choices[0].text, add_special_tokens=False)
    stop_id = ids[len(ids) // 2]
    stopped = client.completions.create(**ask, temperature=0, extra_body={"stop_token_ids": [stop_id]})  # type: ignore[call-overload]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens <= ids.index(stop_id) + 1
