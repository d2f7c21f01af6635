"""Usage: durable (outbox) when the response ends, then one row per request in Postgres (via Kafka and the
billing consumer); `/v1/usage` reports it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import psycopg
from openai import OpenAI

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


def test_an_aborted_stream_is_billed_with_finish_reason_abort(stack: GatewayStack, tenant: Tenant) -> None:
    essay = "Write a long, detailed essay about the history of lighthouses."
    body = {"model": MODEL, "messages": [{"role": "user", "content": essay}], "max_tokens": 300,
            "stream": True}
    with stack.http(tenant.key) as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        data_lines = 0
        for line in r.iter_lines():
            data_lines += line.startswith("data:")
            if data_lines == 3:
                break
    rows = _usage_rows(stack, tenant, 1)
    assert len(rows) == 1
    _, prompt, _, completion, finish, *_ = rows[0]
    assert finish == "abort" and prompt > 0 and 3 <= completion < 300


def test_an_organisation_over_its_monthly_budget_is_refused(stack: GatewayStack) -> None:
    broke = stack.tenant(budget_usd=Decimal(0))
    with stack.http(broke.key) as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "insufficient_quota"
