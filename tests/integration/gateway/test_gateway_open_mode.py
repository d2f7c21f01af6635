"""`BATON_AUTH_MODE=none`: a gateway with no Postgres, Redis or Kafka in front of a real `both` worker.

The environment given to the gateway names no database, Redis or broker at all: the gateway must
start, serve completions (streamed and not) and models without an API key, and refuse conversations
and usage with 501 `feature_disabled`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from services.launcher.supervisor import Supervisor
from tests.support.gateway_stack import MODEL, open_gateway_env, start_gateway, start_worker

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
                               open_gateway_env(worker, default_model_dir, BATON_SSE_KEEPALIVE_S="0.1"))
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
