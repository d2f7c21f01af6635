"""Checks shared by the migration tests: the streamed text, the gateway's migration counters, the ledger."""

from __future__ import annotations

import re
import time

import httpx
import psycopg

from tests.integration.gateway.sse_events import Event
from tests.support.gateway_stack import GatewayStack


def migrations(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^baton_request_migrations_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def billed(stack: GatewayStack, request_id: str) -> list[tuple[int, int]]:
    """The ledger's (prompt, completion) rows of one request, once the billing consumer wrote them."""
    give_up = time.monotonic() + 30
    while True:
        with psycopg.connect(stack.database_url) as conn:
            rows = conn.execute("SELECT prompt_tokens, completion_tokens FROM usage_events WHERE request_id = %s",
                                (request_id,)).fetchall()
        if rows or time.monotonic() > give_up:
            return [tuple(r) for r in rows]
        time.sleep(0.2)


def content(evs: list[Event]) -> str:
    return "".join(c["delta"].get("content") or "" for e in evs if e.data != "[DONE]"
                   for c in e.json.get("choices", []))
