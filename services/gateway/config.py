"""Frozen configuration of the gateway, built once in main from `GatewaySettings` + `BatonSettings`.

The model is described by `ServedModel`: where its tokenizer lives, its name, its context window and
its price. The default model's directory is resolved here without importing `engine.loader.prepare`
(which imports torch): the gateway never loads torch. `baton serve` (or `make model`) prepares the
directory before the gateway starts; a missing one is a clear `ConfigError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from scheduler.types import SLO, Tier
from services.billing.pricing import ModelPrice, PriceTable
from services.common.errors import ConfigError
from services.common.settings import TIERS, BatonSettings
from services.gateway.settings import GatewaySettings, SLOSettings, default_slos

# Mirror engine.loader.prepare and engine.loader.tiny (a test checks they agree); importing them
# would import torch.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TINY_MODEL_NAME = "baton-tiny-random"
PREPARED_MARKER = "baton-prepared.json"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "baton"


def resolve_model_dir(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """The HF directory to read the tokenizer and config from (the prepared default when `model` is None;
    the built-in names are prepared under the cache by `baton serve` or `make model`)."""
    if model is None or model in ("", DEFAULT_MODEL_NAME, TINY_MODEL_NAME):
        name = model or DEFAULT_MODEL_NAME
        path = Path(cache_dir or default_cache_dir()).expanduser() / "models" / name
        if not (path / PREPARED_MARKER).is_file():
            raise ConfigError(f"the model {name} is not prepared at {path}: run `make model` "
                              "(python -m engine.loader.prepare) or set BATON_MODEL")
        return path
    path = Path(model).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"BATON_MODEL={model!r} is not a Hugging Face directory with tokenizer.json")
    return path


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in "model"
    path: Path
    context_window: int  # prompt + completion tokens
    price: ModelPrice  # USD per 1K tokens
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_dir(cls, path: Path, name: str | None, max_model_len: int | None,
                 prices: PriceTable) -> ServedModel:
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path / 'config.json'}: {e}") from e
        window = int(hf.get("max_position_embeddings") or 2048)
        if max_model_len is not None:
            window = min(window, max_model_len)
        served = name or path.name
        return cls(served, path, window, prices.price_for(served))


@dataclass(frozen=True)
class StreamConfig:
    keepalive_s: float = 15.0  # an SSE comment after this long without an event
    replay_window_s: float = 60.0  # how long a finished stream's events stay for Last-Event-ID
    replay_max_events: int = 4096  # per stream; older events are dropped (a resume before them is 410)
    max_streams: int = 10_000  # replay buffers held at once; the oldest finished go first
    detach_grace_s: float = 30.0  # a stream whose client left keeps generating this long (0: abort at once)


def _slos(settings: Mapping[Tier, SLOSettings]) -> dict[str, SLO]:
    merged: dict[Tier, SLOSettings] = {**default_slos(), **settings}
    return {tier: SLO(merged[tier].ttft_ms, merged[tier].tpot_ms) for tier in TIERS}


@dataclass(frozen=True)
class GatewayConfig:
    model: ServedModel  # the default model (BATON_MODEL)
    slos: dict[str, SLO] = field(default_factory=lambda: _slos({}))
    stream: StreamConfig = StreamConfig()
    block_size: int = 16
    default_max_tokens: int = 1024
    retention_days: int = 30  # soft-deleted conversations are purged after this
    purge_interval_s: float = 3600.0
    worker_abort_timeout_s: float = 2.0
    usage_backlog_limit: int = 90_000  # refuse new requests (503) once this many usage events are unsent
    drain_timeout_s: float = 30.0  # on shutdown, running streams get this long to finish
    max_migrations: int = 3  # retries + migrations of one choice whose worker was lost
    max_request_bytes: int = 8 * 1024 * 1024  # request bodies over this are refused (413) unread
    max_header_bytes: int = 32 * 1024  # request heads (request line + headers) over this: 431
    extra_models: tuple[ServedModel, ...] = ()  # served besides `model` (BATON_EXTRA_MODELS)

    @property
    def models(self) -> tuple[ServedModel, ...]:
        return (self.model, *self.extra_models)

    @classmethod
    def from_settings(cls, gw: GatewaySettings, baton: BatonSettings) -> GatewayConfig:
        path = resolve_model_dir(gw.model, gw.cache_dir)
        prices = PriceTable.from_settings(baton)
        model = ServedModel.from_dir(path, gw.served_model_name, gw.max_model_len, prices)
        extra = tuple(ServedModel.from_dir(resolve_model_dir(spec, gw.cache_dir), name, gw.max_model_len, prices)
                      for name, spec in gw.extra_models.items())
        if model.name in gw.extra_models:
            raise ConfigError(f"BATON_EXTRA_MODELS names {model.name!r}, the default model's name")
        stream = StreamConfig(gw.sse_keepalive_s, gw.stream_replay_window_s, gw.stream_replay_max_events,
                              detach_grace_s=gw.stream_detach_grace_s)
        return cls(model, _slos(gw.slos), stream, block_size=gw.block_size,
                   default_max_tokens=gw.default_max_tokens, retention_days=gw.conversation_retention_days,
                   purge_interval_s=gw.purge_interval_s, usage_backlog_limit=int(baton.usage_max_pending * 0.9),
                   drain_timeout_s=gw.drain_timeout_s, max_request_bytes=gw.max_request_bytes,
                   max_header_bytes=gw.max_header_bytes,
                   max_migrations=gw.max_migrations, extra_models=extra)
