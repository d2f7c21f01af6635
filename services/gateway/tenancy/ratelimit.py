"""Per-key and per-organisation RPM + TPM token buckets in Redis, decided in ONE atomic Lua script.

Four buckets guard every request: the key's requests/minute and tokens/minute, and the same two for
its organisation (so several keys of one org together are capped). Each bucket holds up to its limit
and refills continuously at limit/60 per second. The script reads all four, and consumes from all of
them only if every one can pay, so a refused request costs nothing anywhere; it reports the refusing
bucket with the longest wait as retry-after.

Tokens are charged up-front as prompt tokens + max_tokens (the most the request can use) and
reconciled when it ends with the real prompt + completion count: the difference is refunded, or
charged if the estimate was low (a bucket may then go into debt, down to minus its capacity, which
delays the next requests). Time comes from Redis (`TIME`), so gateways with skewed clocks agree.
A bucket that is absent is full; keys expire once a bucket would have refilled.

Redis Cluster: all four keys carry the organisation id as hash tag, so they live in one slot.

Redis unreachable (`RateLimitConfig.on_redis_error`, from `BATON_RATE_LIMIT_ON_REDIS_ERROR`): "open"
admits the request without limits (a lease without limits, so nothing is reconciled later), "closed"
raises `DependencyUnavailableError` (503 + Retry-After). Either way never a 500, and the outage is
logged once, its end once (outage.py). A failed reconcile is only counted: the estimate stays charged.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from scheduler.types import Tier
from services.common.errors import DependencyUnavailableError, RateLimitError
from services.common.settings import BatonSettings, TierLimitSettings
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.outage import OutageLog

if TYPE_CHECKING:  # the gateway without tenants (BATON_AUTH_MODE=none) never imports redis
    from redis.asyncio import Redis

# KEYS: bucket keys. ARGV: capacity_1, cost_1, capacity_2, cost_2, ...
# Returns {admitted 0|1, refusing index (0: none), wait seconds, level_1, ..., level_n} (floats as strings:
# Redis truncates Lua numbers to integers in replies).
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = #KEYS
local level = {}
local refused, wait = 0, 0
for i = 1, n do
  local cap, cost = tonumber(ARGV[2*i-1]), tonumber(ARGV[2*i])
  local rate = cap / 60.0
  local s = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(s[1]), tonumber(s[2])
  if tokens == nil then tokens, ts = cap, now end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
  level[i] = tokens
  if tokens < cost then
    local w = (cost - tokens) / rate
    if w > wait then refused, wait = i, w end
  end
end
if refused == 0 then
  for i = 1, n do
    local cap, cost = tonumber(ARGV[2*i-1]), tonumber(ARGV[2*i])
    level[i] = level[i] - cost
    redis.call('HSET', KEYS[i], 'tokens', level[i], 'ts', now)
    redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level[i]) / (cap / 60.0) * 1000) + 1000)
  end
end
local out = {refused == 0 and 1 or 0, refused, tostring(wait)}
for i = 1, n do out[#out+1] = tostring(level[i]) end
return out
"""

# KEYS: TPM bucket keys. ARGV: capacity_1, capacity_2, ..., delta (tokens to charge; negative refunds).
_ADJUST_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local delta = tonumber(ARGV[#ARGV])
for i = 1, #KEYS do
  local cap = tonumber(ARGV[i])
  local rate = cap / 60.0
  local s = redis.call('HMGET', KEYS[i], 'tokens', 'ts')
  local tokens, ts = tonumber(s[1]), tonumber(s[2])
  if tokens == nil then tokens, ts = cap, now end
  tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
  tokens = math.max(-cap, math.min(cap, tokens - delta))
  redis.call('HSET', KEYS[i], 'tokens', tokens, 'ts', now)
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - tokens) / rate * 1000) + 1000)
end
return 1
"""

_BUCKETS = ("key_rpm", "key_tpm", "org_rpm", "org_tpm")


@dataclass(frozen=True)
class RateLimitConfig:
    tiers: dict[Tier, TierLimitSettings]
    key_prefix: str = "baton:rl"
    on_redis_error: Literal["open", "closed"] = "open"
    retry_after_s: float = 5.0  # told to callers refused while Redis is down ("closed")

    @classmethod
    def from_settings(cls, settings: BatonSettings) -> RateLimitConfig:
        return cls(dict(settings.tier_limits), on_redis_error=settings.rate_limit_on_redis_error)


@dataclass(frozen=True)
class BucketLimits:
    """The four capacities that apply to one principal."""

    key_rpm: int
    key_tpm: int
    org_rpm: int
    org_tpm: int


@dataclass(frozen=True)
class RateLimitStatus:
    """What the `x-ratelimit-*` headers report: the tighter of the key's and the org's buckets."""

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        return {
            "x-ratelimit-limit-requests": str(self.limit_requests),
            "x-ratelimit-remaining-requests": str(self.remaining_requests),
            "x-ratelimit-reset-requests": f"{self.reset_requests_s:.3f}s",
            "x-ratelimit-limit-tokens": str(self.limit_tokens),
            "x-ratelimit-remaining-tokens": str(self.remaining_tokens),
            "x-ratelimit-reset-tokens": f"{self.reset_tokens_s:.3f}s",
        }


@dataclass(frozen=True)
class RateLimitLease:
    """An admitted request: what it was charged, to reconcile when it ends."""

    org_id: uuid.UUID
    key_id: uuid.UUID
    limits: BucketLimits | None  # None: admitted without limits (BATON_AUTH_MODE=none)
    charged_tokens: int
    status: RateLimitStatus | None

    def headers(self) -> dict[str, str]:
        return {} if self.status is None else self.status.headers()


class RateLimiter:
    def __init__(self, redis: Redis, config: RateLimitConfig) -> None:
        self._config = config
        self._acquire = redis.register_script(_ACQUIRE_LUA)
        self._adjust = redis.register_script(_ADJUST_LUA)
        self.outage = OutageLog("redis (rate limits)")
        from redis.exceptions import RedisError

        self._redis_errors: tuple[type[Exception], ...] = (RedisError, OSError)

    def limits_for(self, principal: Principal) -> BucketLimits:
        tier = self._config.tiers[principal.tier]
        return BucketLimits(key_rpm=principal.key_rpm_limit or tier.key_rpm,
                            key_tpm=principal.key_tpm_limit or tier.key_tpm,
                            org_rpm=tier.org_rpm, org_tpm=tier.org_tpm)

    def _keys(self, principal_org: uuid.UUID, key_id: uuid.UUID) -> list[str]:
        p, org = self._config.key_prefix, f"{{{principal_org}}}"  # {org} is the cluster hash tag
        return [f"{p}:{org}:key:{key_id}:rpm", f"{p}:{org}:key:{key_id}:tpm",
                f"{p}:{org}:org:rpm", f"{p}:{org}:org:tpm"]

    async def acquire(self, principal: Principal, estimated_tokens: int) -> RateLimitLease:
        """Admit one request costing `estimated_tokens` (prompt + max_tokens) or raise RateLimitError."""
        limits = self.limits_for(principal)
        caps = (limits.key_rpm, limits.key_tpm, limits.org_rpm, limits.org_tpm)
        costs = (1, estimated_tokens, 1, estimated_tokens)
        _refuse_if_never_admissible(caps, costs)
        args: list[int] = [v for pair in zip(caps, costs, strict=True) for v in pair]
        try:
            reply = await self._acquire(keys=self._keys(principal.org_id, principal.key_id), args=args)
        except self._redis_errors as e:
            self.outage.failed(e)
            if self._config.on_redis_error == "closed":
                raise DependencyUnavailableError("rate limiting is unavailable (Redis unreachable); retry later",
                                                 self._config.retry_after_s) from e
            return RateLimitLease(principal.org_id, principal.key_id, None, estimated_tokens, None)
        self.outage.succeeded()
        admitted, refused, wait = int(reply[0]), int(reply[1]), float(reply[2])
        status = _status(caps, [float(x) for x in reply[3:]])
        if not admitted:
            bucket = _BUCKETS[refused - 1]
            raise RateLimitError(f"rate limit reached on {bucket.replace('_', ' ')} "
                                 f"(limit {caps[refused - 1]}); retry in {wait:.2f}s", bucket, wait,
                                 status.headers() | {"retry-after": str(max(1, math.ceil(wait)))})
        return RateLimitLease(principal.org_id, principal.key_id, limits, estimated_tokens, status)

    async def reconcile(self, lease: RateLimitLease, actual_tokens: int) -> None:
        """Settle a finished (or aborted) request: refund or charge `actual - charged` tokens."""
        delta = actual_tokens - lease.charged_tokens
        if delta == 0 or lease.limits is None:
            return
        keys = self._keys(lease.org_id, lease.key_id)
        try:
            await self._adjust(keys=[keys[1], keys[3]], args=[lease.limits.key_tpm, lease.limits.org_tpm, delta])
        except self._redis_errors as e:
            self.outage.failed(e)


def _refuse_if_never_admissible(caps: tuple[int, ...], costs: tuple[int, ...]) -> None:
    # A request larger than a bucket's capacity would wait forever: refuse it outright, with no retry.
    for bucket, cap, cost in zip(_BUCKETS, caps, costs, strict=True):
        if cost > cap:
            raise RateLimitError(f"request needs {cost} tokens but the {bucket.replace('_', ' ')} limit is "
                                 f"{cap}; lower max_tokens or shorten the prompt", bucket, None)


def _status(caps: tuple[int, ...], levels: list[float]) -> RateLimitStatus:
    def pick(key_i: int, org_i: int) -> tuple[int, int, float]:
        # Report whichever of the key's and org's bucket has less left, with its time to refill fully.
        i = key_i if levels[key_i] <= levels[org_i] else org_i
        remaining = max(0, math.floor(levels[i]))
        reset = max(0.0, (caps[i] - levels[i]) / (caps[i] / 60.0))
        return caps[i], remaining, reset

    req, tok = pick(0, 2), pick(1, 3)
    return RateLimitStatus(req[0], req[1], req[2], tok[0], tok[1], tok[2])
