"""`GatewaySettings`: the gateway's own `BATON_*` environment variables, read in its main only.

The platform-wide ones (database, Redis, Kafka, pricing, tier limits) stay in `BatonSettings`; these
say where the rest of the cluster is and how the HTTP edge behaves. Lists are JSON in the environment,
e.g. `BATON_WORKER_ADDRESSES='["127.0.0.1:50061"]'`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.types import Tier


class SLOSettings(BaseModel):
    """The latency targets the scheduler places a tier's requests for."""

    model_config = ConfigDict(frozen=True)

    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)


def default_slos() -> dict[Tier, SLOSettings]:
    # Lax on purpose: the default cluster is a CPU laptop; GPU deployments set BATON_SLOS.
    return {Tier.FREE: SLOSettings(ttft_ms=20_000, tpot_ms=1_000),
            Tier.PLUS: SLOSettings(ttft_ms=10_000, tpot_ms=500),
            Tier.ENTERPRISE: SLOSettings(ttft_ms=5_000, tpot_ms=250)}


class GatewaySettings(BaseSettings):
    """Gateway settings; env prefix `BATON_`, e.g. `BATON_SCHEDULER_ADDRESS`."""

    model_config = SettingsConfigDict(env_prefix="BATON_", extra="ignore", frozen=True)

    # Tenants: "api_key" (keys, budgets, conversations in Postgres, rate limits in Redis, usage to Kafka)
    # or "none": no key checked, every caller one anonymous organisation at `anonymous_tier`, no rate
    # limits, budgets, billing or conversation storage. For benchmarks and single-user development only.
    auth_mode: Literal["api_key", "none"] = "api_key"
    anonymous_tier: Tier = Tier.ENTERPRISE

    # Routing: a scheduler, or (no scheduler) a static list of decode-capable worker addresses.
    scheduler_address: str | None = None
    worker_addresses: list[str] = Field(default_factory=list)
    safety_address: str | None = None  # None: no safety checks (development only)
    # Sent on every call to the scheduler, workers and safety (services/common/cluster_auth.py).
    cluster_token: SecretStr | None = None

    # The served model: a prepared HF directory (None: the default model in the cache).
    model: str | None = None
    served_model_name: str | None = None  # None: the model directory's name
    # More served models, name -> HF directory (or a built-in name such as "baton-tiny-random"), e.g.
    # BATON_EXTRA_MODELS='{"tiny": "baton-tiny-random"}'; each needs workers registered under its name.
    extra_models: dict[str, str] = Field(default_factory=dict)
    cache_dir: str | None = None
    max_model_len: int | None = Field(default=None, ge=16)  # None: the model's max_position_embeddings
    block_size: int = Field(default=16, ge=1)  # must equal the workers' KV block size (prefix hashes)
    default_max_tokens: int = Field(default=1024, ge=1)
    slos: dict[Tier, SLOSettings] = Field(default_factory=default_slos)

    # Gateway processes on this host, sharing its port (services/gateway/replicas.py): one event loop
    # streams ~7-8k tokens/s on the benchmark hosts, so a host serving more runs several.
    gateway_processes: int = Field(default=1, ge=1, le=256)  # BATON_GATEWAY_PROCESSES
    sse_keepalive_s: float = Field(default=15.0, gt=0)
    stream_replay_window_s: float = Field(default=60.0, ge=0)
    stream_replay_max_events: int = Field(default=4096, ge=16)
    stream_detach_grace_s: float = Field(default=30.0, ge=0)  # a disconnected stream keeps generating
    max_migrations: int = Field(default=3, ge=0)  # a choice's worker lost: re-placed at most this often
    drain_timeout_s: float = Field(default=30.0, ge=0)
    max_request_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)  # larger bodies: 413 before parsing
    max_header_bytes: int = Field(default=32 * 1024, ge=1024)  # larger request heads: 431 (header_limit.py)
    conversation_retention_days: int = Field(default=30, ge=0)
    purge_interval_s: float = Field(default=3600.0, gt=0)

    # The internal gRPC API (services/gateway/grpc_api) on this port of the gateway's host; None: off.
    # TLS when both PEM files are set (certificate chain and private key).
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None

    otel_exporter: str = "none"  # none | console | otlp (otlp needs opentelemetry-exporter-otlp)
    log_level: str = "INFO"
