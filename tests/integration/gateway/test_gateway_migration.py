"""A decode worker killed (SIGKILL) under a running request: retried before its first token, migrated
after it (services/gateway/completions/migration.py), on real `both` workers and gateways of the session's stack.

Two workers of their own (the module kills them) behind gateways with static routing over both. Each
gateway avoids a worker it saw die, so the tests that need a gateway unaware of a death start a fresh
one. Greedy decoding makes "the migrated text equals the uninterrupted text" an exact check.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from rpcgen.baton.v1 import worker_pb2 as wpb
from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
from tests.integration.gateway.migration_checks import billed, content, migrations
from tests.integration.gateway.sse_events import Event, events
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant, start_worker

PROMPT = [{"role": "user", "content": "Write a detailed essay about the history of the Roman Empire."}]
MAX_TOKENS = 64


@dataclass
class Fleet:
    stack: GatewayStack
    workers: dict[str, str]  # supervisor name -> address (gateways route over all, dead ones too)
    gateways: list[str]
    dead: set[str] = field(default_factory=set)

    def gateway(self, name: str, **env: str) -> str:
        self.gateways.append(name)
        _, url = self.stack.start_gateway(name, BATON_WORKER_ADDRESSES=json.dumps(list(self.workers.values())), **env)
        return url

    def busy_worker(self) -> str:
        """The name of the worker running a sequence now."""
        for name, address in self.workers.items():
            if name in self.dead:
                continue
            with grpc.insecure_channel(address) as channel:
                try:
                    status = wpb_grpc.WorkerStub(channel).GetStatus(wpb.StatusRequest(), timeout=2)
                except grpc.RpcError:
                    continue
            if status.running_seqs:
                return name
        raise AssertionError("no worker is running the request")

    def kill(self, name: str) -> None:
        self.dead.add(name)
        os.kill(self.stack.supervisor.pids()[name], signal.SIGKILL)
        give_up = time.monotonic() + 10
        while name in self.stack.supervisor.pids() and time.monotonic() < give_up:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(gateway_stack: GatewayStack) -> Iterator[Fleet]:
    names = ["worker-m1", "worker-m2"]
    workers = {name: start_worker(gateway_stack.supervisor, name, "both", gateway_stack.model_dir) for name in names}
    fleet = Fleet(gateway_stack, workers, [])
    yield fleet
    for name in [*fleet.gateways, *names]:
        gateway_stack.supervisor.stop_child(name)


def body(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def complete(url: str, tenant: Tenant) -> httpx.Response:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as http:
        return http.post("/v1/chat/completions", json=body(False))


def stream_events(url: str, tenant: Tenant, on_event: object = None) -> list[Event]:
    """Every SSE event of one streamed request; `on_event(i)` runs after the i-th event arrived."""
    got: list[Event] = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body(True)) as response:
        assert response.status_code == 200
        for event in events(response.iter_lines()):
            got.append(event)
            if callable(on_event):
                on_event(len(got))
    return got


def test_a_request_the_worker_refuses_is_not_retried(fleet: Fleet, tenant: Tenant) -> None:
    # The gateway allows a longer context than the workers: the worker refuses (INVALID_ARGUMENT).
    url = fleet.gateway("gateway-m-wide", BATON_MAX_MODEL_LEN="4096")
    long = [{"role": "user", "content": "the sea is calm and blue today. " * 320}]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert "context window" in response.json()["error"]["message"]
    assert migrations(url) == {}  # neither retried nor migrated, and no worker reported lost


def test_a_worker_killed_mid_stream_is_migrated_and_the_greedy_text_is_unchanged(
        fleet: Fleet, tenant: Tenant) -> None:
    url = fleet.gateway("gateway-m1")
    reference = complete(url, tenant).json()
    expected = reference["choices"][0]["message"]["content"]
    assert reference["usage"]["completion_tokens"] >= 40, "the reference must outlast the kill"
    killed: list[str] = []

    def kill_after_a_few_tokens(received: int) -> None:
        if received == 6 and not killed:
            killed.append(fleet.busy_worker())
            fleet.kill(killed[0])

    evs = stream_events(url, tenant, kill_after_a_few_tokens)
    assert killed, "the stream ended before the kill"
    assert content(evs) == expected
    assert evs[-1].data == "[DONE]" and not any("error" in e.json for e in evs[:-1])
    chunks = [e.json for e in evs[:-1]]
    assert len({c["id"] for c in chunks}) == 1  # one response id across the seam
    ids = [e.id.rpartition(":") for e in evs]  # "<stream id>:<sequence>"
    assert {stream for stream, _, _ in ids} == {chunks[0]["id"]}
    first = int(ids[0][2])
    assert [int(seq) for _, _, seq in ids] == list(range(first, first + len(evs)))  # no gap, no repeat
    # Usage counts what the client received, once: the re-prefilled prompt and tokens are not billed twice.
    assert chunks[-1]["usage"] == reference["usage"]
    usage = reference["usage"]
    assert billed(fleet.stack, chunks[0]["id"]) == [(usage["prompt_tokens"], usage["completion_tokens"])]
    assert migrations(url) == {"migrated": 1.0}


def test_a_worker_dead_before_the_first_token_is_retried_invisibly(fleet: Fleet, tenant: Tenant) -> None:
    assert fleet.dead, "runs after the mid-stream kill: one worker is dead, the other alive"
    url = fleet.gateway("gateway-m2")  # new: it has not seen the death; round-robin sends one request there
    answers = [complete(url, tenant) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]
    assert migrations(url) == {"retried": 1.0}  # then the dead worker is avoided


def test_past_the_migration_limit_the_stream_ends_with_a_clean_error(fleet: Fleet, tenant: Tenant) -> None:
    url = fleet.gateway("gateway-m3", BATON_MAX_MIGRATIONS="0")
    outcomes = [stream_events(url, tenant) for _ in range(2)]
    failed = [evs for evs in outcomes if any("error" in e.json for e in evs if e.data != "[DONE]")]
    assert len(failed) == 1  # the one routed to the dead worker
    error = next(e.json["error"] for e in failed[0] if e.data != "[DONE]" and "error" in e.json)
    assert "unavailable" in error["message"] and failed[0][-1].data == "[DONE]"
    assert migrations(url) == {"limit_exceeded": 1.0}


def test_with_no_worker_left_the_stream_ends_with_a_clean_error(fleet: Fleet, tenant: Tenant) -> None:
    url = fleet.gateway("gateway-m4")
    [alive] = [name for name in fleet.workers if name not in fleet.dead]
    killed: list[str] = []

    def kill_the_last_worker(received: int) -> None:
        if received == 3 and not killed:
            killed.append(alive)
            fleet.kill(alive)

    evs = stream_events(url, tenant, kill_the_last_worker)
    assert evs[-1].data == "[DONE]"
    assert any("error" in e.json for e in evs[:-1])
    assert migrations(url).get("no_worker") == 1.0
