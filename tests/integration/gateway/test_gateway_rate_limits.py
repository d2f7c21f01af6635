"""RPM/TPM limits per request: a concurrent burst admits exactly what the bucket holds."""

from __future__ import annotations

import asyncio

import httpx
from openai import AsyncOpenAI

from tests.support.gateway_stack import MODEL, GatewayStack

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def _burst(url: str, key: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        return list(await asyncio.gather(*(http.post("/v1/chat/completions", json=BODY) for _ in range(n))))


def test_a_burst_admits_no_more_than_the_request_bucket(stack: GatewayStack) -> None:
    tenant = stack.tenant(rpm=4)
    responses = asyncio.run(_burst(stack.url, tenant.key, 12))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) == 4 and len(refused) == 8
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-limit-requests"] == "4"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert ok[0].headers["x-ratelimit-limit-requests"] == "4"
    assert int(ok[0].headers["x-ratelimit-remaining-requests"]) < 4


def test_a_request_larger_than_the_token_bucket_is_refused_at_once(stack: GatewayStack) -> None:
    tenant = stack.tenant(tpm=100)
    with stack.http(tenant.key) as http:
        r = http.post("/v1/chat/completions", json={**BODY, "max_tokens": 500})
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "tokens"
    assert "retry-after" not in r.headers  # waiting would never help


def test_the_openai_sdk_sees_the_429(stack: GatewayStack) -> None:
    tenant = stack.tenant(rpm=1)

    async def two() -> tuple[object, object]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=tenant.key, max_retries=0)
        results = await asyncio.gather(*(client.chat.completions.create(**BODY) for _ in range(2)),
                                       return_exceptions=True)
        await client.close()
        return results[0], results[1]

    outcomes = asyncio.run(two())
    statuses = sorted(getattr(o, "status_code", 200) for o in outcomes)
    assert statuses == [200, 429]
