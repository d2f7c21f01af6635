"""Usage: durable (outbox) when the response ends, then one row per request in Postgres (via Kafka and the
billing consumer); `/v1/usage` reports it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from itertools import islice

import psycopg
from openai import OpenAI

from tests.integration.gateway.sse_events import Event, events
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant


def _usage_rows(stack: GatewayStack, tenant: Tenant, expected: int, timeout_s: float = 30) -> list[tuple]:
    deadline = time.monotonic() + timeout_s
    while True:
        with psycopg.connect(stack.database_url) as conn:
            rows = conn.execute(
                "SELECT request_id, prompt_tokens, cached_tokens, completion_tokens, finish_reason, api_key_id, "
                "ttft_ms, e2e_ms FROM usage_events WHERE org_id = %s ORDER BY created_at",
                (tenant.org_id,)).fetchall()
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _durable(stack: GatewayStack, ids: set[str]) -> set[str]:
    with psycopg.connect(stack.database_url) as conn:
        rows = conn.execute("SELECT request_id FROM usage_outbox WHERE request_id = ANY(%(ids)s) UNION "
                            "SELECT request_id FROM usage_events WHERE request_id = ANY(%(ids)s)",
                            {"ids": list(ids)}).fetchall()
    return {r[0] for r in rows}


def test_each_request_is_one_usage_row_with_the_response_counts(client: OpenAI, stack: GatewayStack,
                                                                 tenant: Tenant) -> None:
    replies = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Say {w}"}],
                                              max_tokens=3, temperature=0) for w in ("yes", "no")]
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say maybe"}], max_tokens=3, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    # Durable the moment the response ended ([DONE] for the stream): in the outbox, or billed already.
    ids = {r.id for r in replies} | {streamed[0].id}
    assert _durable(stack, ids) == ids
    rows = _usage_rows(stack, tenant, 3)
    assert len(rows) == 3
    expected = {r.id: r.usage for r in replies} | {streamed[0].id: streamed[-1].usage}
    for request_id, prompt, cached, completion, finish, key_id, ttft, e2e in rows:
        usage = expected[request_id]
        assert (prompt, cached, completion) == (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                                                 usage.completion_tokens)
        assert finish in ("stop", "length") and key_id == tenant.key_id
        assert 0 < ttft <= e2e
    time.sleep(0.5)
    assert len(_usage_rows(stack, tenant, 4, timeout_s=0)) == 3  # exactly once


def test_the_usage_endpoint_sums_the_rows(client: OpenAI, stack: GatewayStack, tenant: Tenant) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert len(_usage_rows(stack, tenant, 1)) == 1
    today = datetime.now(UTC).date()
    with stack.http(tenant.key) as http:
        r = http.get("/v1/usage", params={"start": str(today - timedelta(days=1)), "group_by": "model"})
        bad = http.get("/v1/usage", params={"start": "yesterday"})
    assert r.status_code == 200
    body = r.json()
    assert body["data"][0]["model"] == MODEL
    assert body["total"]["requests"] == 1
    assert body["total"]["input_tokens"] == reply.usage.prompt_tokens  # type: ignore[union-attr]
    assert body["total"]["output_tokens"] == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None


ESSAY_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long, detailed essay about the "
                                                                    "history of lighthouses."}],
              "max_tokens": 300, "stream": True, "stream_options": {"include_usage": True}}


def _assert_billed_as_aborted(stack: GatewayStack, tenant: Tenant, stream: list[Event]) -> None:
    """`stream` (to its [DONE]) ended in an abort; its one usage row has finish reason abort and the usage
    the stream reported: the tokens delivered before the abort, not `max_tokens`."""
    reasons = [c["finish_reason"] for e in stream[:-1] for c in e.json["choices"] if c["finish_reason"]]
    usage = stream[-2].json["usage"]
    assert reasons == ["abort"] and stream[-1].data == "[DONE]"
    rows = _usage_rows(stack, tenant, 1)
    assert len(rows) == 1
    request_id, prompt, _, completion, finish, *_ = rows[0]
    assert (request_id, finish) == (stream[0].json["id"], "abort")
    assert (prompt, completion) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert prompt > 0 and 3 <= completion < 300


def test_a_cancelled_stream_is_billed_with_finish_reason_abort(stack: GatewayStack, tenant: Tenant) -> None:
    with stack.http(tenant.key) as http, http.stream("POST", "/v1/chat/completions", json=ESSAY_BODY) as r:
        lines = r.iter_lines()
        head = list(islice(events(lines), 3))
        cancel = http.post(f"/v1/chat/completions/{head[0].json['id']}/cancel")
        assert cancel.status_code == 200 and cancel.json()["cancelled"] is True
        stream = head + list(events(lines))  # still attached: the rest arrives, ending in the abort
    _assert_billed_as_aborted(stack, tenant, stream)


def test_a_disconnect_without_detach_grace_is_billed_with_finish_reason_abort(stack: GatewayStack,
                                                                             tenant: Tenant) -> None:
    # This stack's gateway runs with no grace, so a disconnect aborts at once (with the default grace the
    # stream would keep generating for a resume: tests/integration/gateway/test_gateway_stream_resume.py).
    assert stack.gateway_env()["BATON_STREAM_DETACH_GRACE_S"] == "0"
    with stack.http(tenant.key) as http, http.stream("POST", "/v1/chat/completions", json=ESSAY_BODY) as r:
        head = list(islice(events(r.iter_lines()), 3))
    stack.wait_worker_idle(timeout_s=20)  # the abort freed the sequence
    with stack.http(tenant.key) as http, http.stream("GET", f"/v1/streams/{head[0].json['id']}",
                                                     headers={"Last-Event-ID": head[-1].id}) as r:
        rest = list(events(r.iter_lines()))  # the replay log, up to the abort and its usage
    _assert_billed_as_aborted(stack, tenant, head + rest)


def test_an_organisation_over_its_monthly_budget_is_refused(stack: GatewayStack) -> None:
    broke = stack.tenant(budget_usd=Decimal(0))
    with stack.http(broke.key) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "insufficient_quota"
