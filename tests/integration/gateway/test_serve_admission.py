"""A default `baton serve` (scheduler, prefill + decode worker, gateway; CPU, default model)
serves everyone who asks at once: 16 concurrent 96-token streams, an n=2 request and a free-tier
request, all answered, none refused with a 503 (scheduler/core/progress.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.gateway.tenancy.auth import generate_api_key
from services.launcher.postgres import EmbeddedPostgres
from services.launcher.process import free_port
from services.launcher.redis_server import EmbeddedRedis
from services.launcher.tansu import EmbeddedKafka
from tests.integration.gateway.test_gateway_serve import SERVE, _wait_for
from tests.support.gateway_stack import MODEL, create_tenant

STREAMS = 16
# Long enough that the streams still decode when the later requests' admission wait (the enterprise tier's
# 5 s TTFT target) runs out: 16 sequences step at ~0.2-0.5 s on 2 CPU cores, so 96 tokens last 20-50 s.
# 200 tokens (docs/benchmarks.md's probe) held the cluster twice as long for the same decisions.
STREAM_TOKENS = 96


@dataclass(frozen=True)
class Served:
    url: str
    enterprise_key: str  # the local organisation's key (`baton serve --tier enterprise`, the default)
    free_key: str


@dataclass(frozen=True)
class Answer:
    status: int
    choices: int  # choices that finished (a finish_reason was sent)
    done: bool  # a stream ended with [DONE]; a plain response counts as done
    errors: tuple[str, ...] = ()  # error codes sent inside a stream


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, redis_server: EmbeddedRedis,
           kafka_broker: EmbeddedKafka, default_model_dir: Path) -> Iterator[Served]:
    """`baton serve` with its defaults: disaggregated workers, the goodput scheduler, the safety service
    (every prompt judged before placement, every stream's output filtered)."""
    key, port = generate_api_key(), free_port()
    database_url = postgres.create_database(f"baton_admission_{uuid.uuid4().hex[:6]}")
    env = {**os.environ, "BATON_API_KEY": key, "BATON_DATABASE_URL": database_url,
           "BATON_REDIS_URL": redis_server.url, "BATON_KAFKA_BOOTSTRAP": kafka_broker.url,
           "BATON_USAGE_TOPIC": f"admission.{uuid.uuid4().hex[:8]}", "BATON_SERVED_MODEL_NAME": MODEL}
    log = tmp_path_factory.mktemp("serve-admission") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--port", str(port), "--model",
                                 str(default_model_dir), "--grpc-port", str(free_port())],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(log, f"Baton is ready: http://127.0.0.1:{port}", proc, 240)
        yield Served(f"http://127.0.0.1:{port}/v1", key, create_tenant(database_url, "free").key)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _chat(client: httpx.AsyncClient, url: str, key: str, body: dict[str, object]) -> Answer:
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        response = await client.post(f"{url}/chat/completions", json=body, headers=headers)
        if response.status_code != 200:
            return Answer(response.status_code, 0, False, (_error_code(response.text),))
        choices = response.json()["choices"]
        return Answer(200, sum(c["finish_reason"] is not None for c in choices), True)
    finished, done, errors = 0, False, []
    async with client.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return Answer(response.status_code, 0, False, (_error_code((await response.aread()).decode()),))
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                finished += sum(c.get("finish_reason") is not None for c in chunk.get("choices", ()))
                if "error" in chunk:
                    errors.append(str(chunk["error"].get("code")))
    return Answer(200, finished, done, tuple(errors))


def _error_code(body: str) -> str:
    """The OpenAI error's code, so a failure says why (admission, safety, limits)."""
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return body[:200]


def _body(text: str, max_tokens: int, stream: bool, n: int = 1) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "n": n}


async def _everyone_at_once(served: Served) -> tuple[list[Answer], Answer, Answer]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        streams = [asyncio.create_task(_chat(client, served.url, served.enterprise_key,
                                             _body(f"Tell me a long story about a lighthouse, number {i}.",
                                                   STREAM_TOKENS, stream=True)))
                   for i in range(STREAMS)]
        await asyncio.sleep(1.0)  # the streams are decoding: the two below arrive at a busy cluster
        pair = _chat(client, served.url, served.enterprise_key, _body("Name two colours.", 16, False, n=2))
        free = _chat(client, served.url, served.free_key, _body("Name a fruit.", 16, stream=True))
        pair_answer, free_answer = await asyncio.gather(pair, free)
        return list(await asyncio.gather(*streams)), pair_answer, free_answer


def test_a_default_serve_answers_16_streams_an_n2_and_a_free_request_with_no_503(served: Served) -> None:
    streams, pair, free = asyncio.run(_everyone_at_once(served))
    assert [a.status for a in streams] == [200] * STREAMS
    assert [(a.done, a.choices, a.errors) for a in streams] == [(True, 1, ())] * STREAMS
    assert (pair.status, pair.choices, pair.errors) == (200, 2, ())
    assert (free.status, free.choices, free.done, free.errors) == (200, 1, True, ())
