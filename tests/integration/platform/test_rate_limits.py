"""RPM/TPM token buckets per key and per organisation, in one atomic Redis script."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from services.common.errors import RateLimitError
from services.common.settings import TierLimitSettings
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.ratelimit import RateLimitConfig, RateLimiter, RateLimitLease

BIG = 10_000_000


def _limiter(redis: Redis, *, key_rpm: int = BIG, key_tpm: int = BIG, org_rpm: int = BIG,
             org_tpm: int = BIG) -> RateLimiter:
    tier = TierLimitSettings(key_rpm=key_rpm, key_tpm=key_tpm, org_rpm=org_rpm, org_tpm=org_tpm)
    prefix = f"test:{uuid.uuid4().hex}"  # fresh buckets for every test
    return RateLimiter(redis, RateLimitConfig({"free": tier, "plus": tier, "enterprise": tier}, prefix))


def _principal(org: uuid.UUID | None = None, rpm: int | None = None, tpm: int | None = None) -> Principal:
    return Principal(uuid.uuid4(), org or uuid.uuid4(), None, "free", rpm, tpm)


async def _burst(limiter: RateLimiter, principals: list[Principal], tokens: int = 1) -> tuple[
        list[RateLimitLease], list[RateLimitError]]:
    results = await asyncio.gather(*(limiter.acquire(p, tokens) for p in principals), return_exceptions=True)
    admitted = [r for r in results if isinstance(r, RateLimitLease)]
    refused = [r for r in results if isinstance(r, RateLimitError)]
    assert len(admitted) + len(refused) == len(principals), results
    return admitted, refused


async def test_concurrent_burst_admits_exactly_the_rpm(redis_client: Redis) -> None:
    limiter = _limiter(redis_client)
    key = _principal(rpm=10)
    admitted, refused = await _burst(limiter, [key] * 50)
    assert len(admitted) == 10
    assert {e.bucket for e in refused} == {"key_rpm"}
    assert all(e.retry_after_s is not None and 0 < e.retry_after_s <= 6.0 for e in refused)
    assert refused[0].headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused[0].headers["retry-after"]) >= 1


async def test_org_bucket_caps_several_keys_together(redis_client: Redis) -> None:
    limiter = _limiter(redis_client, key_rpm=10, org_rpm=15)
    org = uuid.uuid4()
    keys = [_principal(org) for _ in range(3)]
    admitted, refused = await _burst(limiter, [k for k in keys for _ in range(10)])
    assert len(admitted) == 15
    assert {e.bucket for e in refused} == {"org_rpm"}


async def test_refused_request_consumes_nothing(redis_client: Redis) -> None:
    # The key's TPM refuses; its RPM and the org's buckets must be untouched by the refusal.
    limiter = _limiter(redis_client, key_rpm=5, key_tpm=1000)
    key = _principal()
    await limiter.acquire(key, 900)
    for _ in range(3):
        with pytest.raises(RateLimitError) as refused:
            await limiter.acquire(key, 900)
        assert refused.value.bucket == "key_tpm"
    lease = await limiter.acquire(key, 50)
    assert lease.status.remaining_requests == 3  # 5 - the two admitted


async def test_headers_report_the_tighter_of_key_and_org(redis_client: Redis) -> None:
    limiter = _limiter(redis_client, key_rpm=10, key_tpm=5000, org_rpm=100, org_tpm=2000)
    org = uuid.uuid4()
    for _ in range(2):
        await limiter.acquire(_principal(org), 100)
    headers = (await limiter.acquire(_principal(org), 100)).status.headers()
    assert headers["x-ratelimit-limit-requests"] == "10"  # a fresh key: its own bucket is the tighter
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-limit-tokens"] == "2000"  # the three keys share the org's 2000
    assert 1700 <= int(headers["x-ratelimit-remaining-tokens"]) <= 1750  # + refill while running


async def test_tpm_refund_after_reconcile_admits_more(redis_client: Redis) -> None:
    limiter = _limiter(redis_client, key_tpm=1000)
    key = _principal()
    lease = await limiter.acquire(key, 600)  # prompt + max_tokens estimate
    with pytest.raises(RateLimitError):
        await limiter.acquire(key, 600)
    await limiter.reconcile(lease, 100)  # it really used 100: 500 come back
    second = await limiter.acquire(key, 600)
    assert 290 <= second.status.remaining_tokens <= 400  # 300 + refill (16.7/s) while running


async def test_tpm_underestimate_is_charged_after_the_request(redis_client: Redis) -> None:
    limiter = _limiter(redis_client, key_tpm=1000)
    key = _principal()
    lease = await limiter.acquire(key, 100)
    await limiter.reconcile(lease, 700)  # 600 more than charged
    with pytest.raises(RateLimitError) as refused:
        await limiter.acquire(key, 400)
    assert refused.value.bucket == "key_tpm"
    assert await limiter.acquire(key, 250)  # ~300 left


async def test_request_larger_than_capacity_is_refused_without_retry(redis_client: Redis) -> None:
    limiter = _limiter(redis_client, org_tpm=4096)
    with pytest.raises(RateLimitError) as refused:
        await limiter.acquire(_principal(), 5000)
    assert refused.value.bucket == "org_tpm" and refused.value.retry_after_s is None
