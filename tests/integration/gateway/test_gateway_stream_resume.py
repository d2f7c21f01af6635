"""Streams that survive a disconnect, on the real stack: two gateway replicas sharing the session's Redis,
with a detach grace period of `GRACE_S`. A dropped stream keeps generating; a Last-Event-ID resume (on
the same replica or the other one) gets the rest, and the whole text equals an uninterrupted greedy
run; with no reader the grace ends in an abort that frees the KV and bills what was generated; cancel
aborts at once from either replica; another tenant gets 404; with Redis down a replica still resumes
its own streams and answers no 500."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import httpx
import psycopg
import pytest

from services.launcher.process import free_port
from services.launcher.supervisor import ChildSpec, http_ok
from tests.integration.gateway.sse_events import Event, events, text_of
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant

GRACE_S = 5.0
ESSAY = "Write a long, detailed essay about the history of lighthouses."  # greedy output runs long


@pytest.fixture(scope="module")
def replicas(gateway_stack: GatewayStack) -> tuple[str, str]:
    grace = {"BATON_STREAM_DETACH_GRACE_S": str(GRACE_S)}
    _, a = gateway_stack.start_gateway("gateway-detach-a", **grace)
    _, b = gateway_stack.start_gateway("gateway-detach-b", **grace)
    return a, b


def _body(max_tokens: int, content: str = "Count from one to twenty.") -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _http(url: str, tenant: Tenant) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60)


def _full(url: str, tenant: Tenant, body: dict[str, object]) -> list[Event]:
    with _http(url, tenant) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        return list(events(r.iter_lines()))


def _drop_after(url: str, tenant: Tenant, body: dict[str, object], n: int) -> list[Event]:
    """The first `n` events, then the connection is closed."""
    head: list[Event] = []
    with _http(url, tenant) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        for ev in events(r.iter_lines()):
            head.append(ev)
            if len(head) == n:
                break
    return head


def _resume(url: str, tenant: Tenant, last: Event) -> list[Event]:
    stream_id = last.id.rpartition(":")[0]
    with _http(url, tenant) as http, http.stream("GET", f"/v1/streams/{stream_id}",
                                                 headers={"Last-Event-ID": last.id}) as r:
        assert r.status_code == 200, r.read()
        return list(events(r.iter_lines()))


def _finish_reason(evs: list[Event]) -> str | None:
    reasons = [c["finish_reason"] for e in evs if e.data != "[DONE]" for c in e.json.get("choices", [])]
    return next((r for r in reversed(reasons) if r), None)


def _check_whole(head: list[Event], rest: list[Event], reference: list[Event]) -> None:
    stream_id = head[0].json["id"]
    assert [e.id for e in head + rest] == [f"{stream_id}:{i}" for i in range(len(head + rest))]
    assert text_of(head + rest) == text_of(reference)
    assert _finish_reason(rest) == _finish_reason(reference) != "abort"
    assert rest[-1].data == "[DONE]"


def test_a_dropped_stream_keeps_generating_and_a_resume_gets_the_rest(
        replicas: tuple[str, str], stack: GatewayStack, tenant: Tenant) -> None:
    a, _ = replicas
    reference = _full(a, tenant, _body(40))
    head = _drop_after(a, tenant, _body(40), 3)
    time.sleep(1.0)  # generation goes on meanwhile
    _check_whole(head, _resume(a, tenant, head[-1]), reference)


def test_a_resume_through_the_other_replica_gets_the_rest(replicas: tuple[str, str], tenant: Tenant) -> None:
    a, b = replicas
    reference = _full(a, tenant, _body(40))
    head = _drop_after(a, tenant, _body(40), 3)
    _check_whole(head, _resume(b, tenant, head[-1]), reference)
    with _http(b, tenant) as http, http.stream("POST", "/v1/chat/completions", json=_body(40),
                                              headers={"Last-Event-ID": head[-1].id}) as r:
        _check_whole(head, list(events(r.iter_lines())), reference)  # the re-POST form, after it finished


def _usage_row(stack: GatewayStack, request_id: str, timeout_s: float = 30) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(stack.database_url) as conn:
            row = conn.execute("SELECT completion_tokens, finish_reason FROM usage_events WHERE request_id = %s",
                               (request_id,)).fetchone()
        if row is not None:
            return row[0], row[1]
        assert time.monotonic() < deadline, f"no usage row for {request_id}"
        time.sleep(0.2)


def test_the_grace_period_ends_in_an_abort_that_frees_the_kv_and_bills_what_was_generated(
        replicas: tuple[str, str], stack: GatewayStack, tenant: Tenant) -> None:
    a, _ = replicas
    stack.wait_worker_idle()
    generated_before = stack.worker_generated_tokens()
    head = _drop_after(a, tenant, _body(1500, ESSAY), 3)
    time.sleep(1.0)
    assert stack.worker_status().running_seqs == 1  # detached, not aborted
    stack.wait_worker_idle(timeout_s=GRACE_S + 20)  # 1500 tokens take minutes here: this is the abort
    rest = _resume(a, tenant, head[-1])
    assert _finish_reason(rest) == "abort" and rest[-1].data == "[DONE]"
    usage = rest[-2].json["usage"]
    billed, reason = _usage_row(stack, head[0].json["id"])
    assert reason == "abort" and billed == usage["completion_tokens"] > 3
    # Billed: every token delivered into the stream's log (what a resume can still fetch). The worker may
    # have sampled a step more after the gateway cut the call; that token never left it and is not billed.
    assert 0 <= stack.worker_generated_tokens() - generated_before - billed <= 2


def test_cancel_aborts_at_once_from_either_replica(replicas: tuple[str, str], stack: GatewayStack,
                                                    tenant: Tenant) -> None:
    a, b = replicas
    for canceller in (b, a):
        stack.wait_worker_idle()
        with _http(a, tenant) as http, http.stream("POST", "/v1/chat/completions", json=_body(1500, ESSAY)) as r:
            lines = r.iter_lines()
            first = next(events(lines))
            stream_id = first.json["id"]
            with _http(canceller, tenant) as other:
                reply = other.post(f"/v1/chat/completions/{stream_id}/cancel")
            assert reply.status_code == 200 and reply.json()["cancelled"] is True
            rest = list(events(lines))  # the open stream ends now, long before 1500 tokens
        assert _finish_reason(rest) == "abort" and rest[-1].data == "[DONE]"
        stack.wait_worker_idle(timeout_s=10)
        with _http(canceller, tenant) as other:
            again = other.post(f"/v1/chat/completions/{stream_id}/cancel")
        assert again.status_code == 200 and again.json()["cancelled"] is False


def test_another_tenant_gets_404_for_resume_and_cancel(replicas: tuple[str, str], stack: GatewayStack,
                                                       tenant: Tenant) -> None:
    a, b = replicas
    head = _drop_after(a, tenant, _body(40), 2)
    stream_id = head[0].json["id"]
    other = stack.tenant()
    for url in (a, b):
        with _http(url, other) as http:
            assert http.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": head[-1].id}).status_code == 404
            assert http.post(f"/v1/completions/{stream_id}/cancel").status_code == 404
    assert _finish_reason(_resume(b, tenant, head[-1])) != "abort"  # untouched by the other tenant


@pytest.fixture(scope="module")
def redis_down_url(gateway_stack: GatewayStack) -> Iterator[str]:
    """A replica whose Redis is unreachable (rate limits fail open; readiness would fail, so liveness)."""
    port = free_port()
    env = gateway_stack.gateway_env(BATON_STREAM_DETACH_GRACE_S=str(GRACE_S),
                                    BATON_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    gateway_stack.supervisor.start(ChildSpec(
        "gateway-no-redis", [sys.executable, "-m", "services.gateway", "--port", str(port)],
        http_ok(f"http://127.0.0.1:{port}/healthz"), env=env, ready_timeout_s=60, stop_timeout_s=30))
    yield f"http://127.0.0.1:{port}"


def test_with_redis_down_a_replica_resumes_its_own_streams_and_answers_no_500(
        redis_down_url: str, stack: GatewayStack, tenant: Tenant) -> None:
    reference = _full(redis_down_url, tenant, _body(40))
    head = _drop_after(redis_down_url, tenant, _body(40), 3)
    _check_whole(head, _resume(redis_down_url, tenant, head[-1]), reference)
    with _http(redis_down_url, tenant) as http:
        assert http.get("/v1/streams/chatcmpl-elsewhere").status_code == 503  # maybe on a replica it can't ask
        assert http.post("/v1/chat/completions/chatcmpl-elsewhere/cancel").status_code == 503
    assert "redis-streams unreachable" in stack.log_tail("gateway-no-redis", 400)
