"""`BatonSettings`: every `BATON_*` environment variable of the platform services, read in main only.

Components never read the environment: a service's main builds `BatonSettings()` once and hands each
component its frozen config (`PriceTable.from_settings`, `RateLimitConfig.from_settings`, ...).
Structured values are JSON in the environment, e.g.
`BATON_PRICING='{"*": {"input": 0.0002, "cached_input": 0.0001, "output": 0.0008}}'`.

The three infrastructure URLs are optional: unset means "start an embedded one" (`baton serve`,
tests); set means "use this external service" (Kubernetes, production).
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.types import Tier

# The customer tier is the scheduler's enum, defined once (scheduler/types.py, a leaf that imports nothing of ours).
TIERS: tuple[Tier, ...] = tuple(Tier)

KafkaConfigValue = str | int | float | bool


class ModelPriceSettings(BaseModel):
    """USD per 1,000 tokens. `input` is charged on uncached prompt tokens, `cached_input` on cached ones."""

    model_config = ConfigDict(frozen=True)

    input: Decimal = Field(ge=0)
    cached_input: Decimal = Field(ge=0)
    output: Decimal = Field(ge=0)


class TierLimitSettings(BaseModel):
    """Default limits of a tier: per API key (when the key sets none) and per organisation."""

    model_config = ConfigDict(frozen=True)

    key_rpm: int = Field(gt=0)
    key_tpm: int = Field(gt=0)
    org_rpm: int = Field(gt=0)
    org_tpm: int = Field(gt=0)


def _default_pricing() -> dict[str, ModelPriceSettings]:
    # "*" prices any model without its own entry, so an event for a new model is never unbillable.
    return {"*": ModelPriceSettings(input=Decimal("0.0002"), cached_input=Decimal("0.0001"),
                                    output=Decimal("0.0008"))}


def _default_tier_limits() -> dict[Tier, TierLimitSettings]:
    return {
        Tier.FREE: TierLimitSettings(key_rpm=20, key_tpm=40_000, org_rpm=60, org_tpm=120_000),
        Tier.PLUS: TierLimitSettings(key_rpm=300, key_tpm=300_000, org_rpm=1_000, org_tpm=1_000_000),
        Tier.ENTERPRISE: TierLimitSettings(key_rpm=3_000, key_tpm=3_000_000, org_rpm=10_000,
                                        org_tpm=10_000_000),
    }


class BatonSettings(BaseSettings):
    """Platform settings; env prefix `BATON_`, e.g. `BATON_DATABASE_URL`."""

    model_config = SettingsConfigDict(env_prefix="BATON_", extra="ignore", frozen=True)

    database_url: str | None = None
    redis_url: str | None = None
    kafka_bootstrap: str | None = None

    db_pool_min_size: int = Field(default=1, ge=0)
    db_pool_max_size: int = Field(default=10, ge=1)

    usage_topic: str = "baton.usage"
    billing_group_id: str = "baton-billing"
    billing_batch_size: int = Field(default=500, ge=1)
    # How long librdkafka keeps retrying one event before the producer rebuilds itself and re-sends.
    usage_delivery_timeout_ms: int = Field(default=30_000, ge=1_000)
    usage_max_pending: int = Field(default=100_000, ge=1)
    # Extra librdkafka settings (security.protocol, sasl.*, test timeouts); they override defaults.
    kafka_producer_config: dict[str, KafkaConfigValue] = Field(default_factory=dict)
    kafka_consumer_config: dict[str, KafkaConfigValue] = Field(default_factory=dict)
    billing_metrics_port: int | None = None
    # Where a gateway spools usage while Postgres cannot take its outbox rows (fsynced JSON lines,
    # drained into the outbox when Postgres is back). Must survive a gateway restart: a persistent disk.
    usage_spool_dir: Path = Field(default_factory=lambda: Path.home() / ".local" / "state" / "baton" / "usage-spool")
    # A published usage event the ledger still lacks after it ingested events for this long is
    # published again (the broker lost it); see services/billing/relay.py.
    usage_confirm_timeout_s: float = Field(default=10.0, gt=0)

    pricing: dict[str, ModelPriceSettings] = Field(default_factory=_default_pricing)
    tier_limits: dict[Tier, TierLimitSettings] = Field(default_factory=_default_tier_limits)
    # Redis unreachable: "open" admits requests without rate limits (budgets still apply; logged once per
    # outage), "closed" refuses them with 503 + Retry-After. Never a 500.
    rate_limit_on_redis_error: Literal["open", "closed"] = "open"

    @field_validator("pricing")
    @classmethod
    def _pricing_has_fallback(cls, v: dict[str, ModelPriceSettings]) -> dict[str, ModelPriceSettings]:
        if "*" not in v:
            raise ValueError('BATON_PRICING needs a "*" entry that prices models without their own')
        return v

    @field_validator("tier_limits")
    @classmethod
    def _every_tier(cls, v: dict[Tier, TierLimitSettings]) -> dict[Tier, TierLimitSettings]:
        missing = [t for t in TIERS if t not in v]
        if missing:
            raise ValueError(f"BATON_TIER_LIMITS lacks tiers {missing}; valid tiers: {list(TIERS)}")
        return v
