"""Entry points of the safety service: `baton safety ...` and `python -m services.safety ...`.

This is the only place the safety service reads the environment (`BATON_SAFETY_*`, via
pydantic-settings); command-line flags override it. SIGTERM/SIGINT drain gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common.cluster_auth import ClusterToken
from services.common.errors import BatonError, ConfigError
from services.common.tracing import setup_tracing
from services.safety.batcher import BatchConfig, Batching
from services.safety.encoder import EncoderRuntime
from services.safety.guard import GuardConfig
from services.safety.server import SafetyServer, SafetyServerConfig
from services.safety.service import BATCHED_POOLS, PoolSizes

log = logging.getLogger("services.safety")


class SafetySettings(BaseSettings):
    """`BATON_SAFETY_HOST`, `_PORT`, `_METRICS_PORT`, `_POLICY_FILE`, `_GRACE_S`, the encoder
    (`_ENCODER_RUNTIME` onnx|numpy|torch|auto, `_DEVICE` cpu|cuda[:N], `_ENCODER_THREADS`), capacity
    (`_INPUT_THREADS`, `_LONG_INPUT_THREADS`, `_OUTPUT_THREADS`, `_BATCHING`, `_BATCH_WAIT_MS`,
    `_BATCH_MAX_TEXTS`, `_BATCH_WORKERS`: docs/operations.md, "Safety"), and the optional guard model:
    `_GUARD_URL`, `_GUARD_MODEL`, `_GUARD_API_KEY`, `_GUARD_BUDGET_MS`."""

    model_config = SettingsConfigDict(env_prefix="BATON_SAFETY_", extra="ignore", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(default=50071, ge=0, le=65535)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    policy_file: Path | None = None
    grace_s: float = Field(default=5.0, ge=0)
    encoder_threads: int = Field(default=2, ge=1)
    encoder_runtime: EncoderRuntime = EncoderRuntime.ONNX
    device: str = Field(default="cuda", pattern=r"^(cpu|cuda(:\d+)?)$")
    # Unset: 2/1/1 unbatched, 8/2/16 batched (BATCHED_POOLS); setting one sets all three, the others
    # taking the batched sizes.
    input_threads: int | None = Field(default=None, ge=1)
    long_input_threads: int | None = Field(default=None, ge=1)
    output_threads: int | None = Field(default=None, ge=1)
    batching: Batching = Batching.AUTO
    batch_wait_ms: float = Field(default=2.0, ge=0, le=100)
    batch_max_texts: int | None = Field(default=None, ge=1)  # None: one encoder pass (32 CPU, 128 GPU)
    batch_workers: int = Field(default=2, ge=1)
    guard_url: str | None = None
    guard_model: str | None = None
    guard_api_key: str = ""
    guard_budget_ms: float = Field(default=300.0, gt=0)


def add_safety_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="bind address (default 0.0.0.0 or BATON_SAFETY_HOST)")
    parser.add_argument("--port", type=int, default=None, help="gRPC port (default 50071 or BATON_SAFETY_PORT)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (off by default)")
    parser.add_argument("--policy", type=Path, default=None,
                        help="policy file, JSON or YAML: a default policy + per-organisation overrides")
    parser.add_argument("--grace-s", type=float, default=None, help="drain time on SIGTERM (default 5)")
    parser.add_argument("--guard-url", default=None,
                        help="a Baton gateway serving a guard model (Llama Guard format); off by default")
    parser.add_argument("--guard-model", default=None, help="the guard model's name on that gateway")
    parser.add_argument("--guard-budget-ms", type=float, default=None, help="wait at most this for the guard (300)")


def register_safety_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `baton safety --port P [--policy FILE]` to the `baton` console script."""
    p = subparsers.add_parser("safety", help="run the safety service (input pre-filter, output post-filter)")
    add_safety_arguments(p)
    p.set_defaults(func=run_safety_command)


def config_from(args: argparse.Namespace, settings: SafetySettings,
                environ: Mapping[str, str] | None = None) -> SafetyServerConfig:
    """Flags override the environment (`environ`: the cluster token's; default os.environ)."""
    environ = os.environ if environ is None else environ
    return SafetyServerConfig(
        host=settings.host if args.host is None else args.host,
        port=settings.port if args.port is None else args.port,
        metrics_port=settings.metrics_port if args.metrics_port is None else args.metrics_port,
        policy_path=settings.policy_file if args.policy is None else args.policy,
        grace_s=settings.grace_s if args.grace_s is None else args.grace_s,
        encoder_threads=settings.encoder_threads,
        encoder_runtime=settings.encoder_runtime,
        device=settings.device,
        pools=_pools(settings),
        batching=settings.batching,
        batch=BatchConfig(settings.batch_wait_ms / 1000, settings.batch_max_texts, settings.batch_workers),
        guard=_guard_config(args, settings),
        cluster_token=ClusterToken.from_environ(environ),
    )



def _pools(settings: SafetySettings) -> PoolSizes | None:
    sizes = (settings.input_threads, settings.long_input_threads, settings.output_threads)
    if all(size is None for size in sizes):
        return None  # the server sizes them by whether it batches
    defaults = (BATCHED_POOLS.input, BATCHED_POOLS.long_input, BATCHED_POOLS.output)
    return PoolSizes(*(default if size is None else size for size, default in zip(sizes, defaults, strict=True)))


def _guard_config(args: argparse.Namespace, settings: SafetySettings) -> GuardConfig | None:
    url = settings.guard_url if args.guard_url is None else args.guard_url
    model = settings.guard_model if args.guard_model is None else args.guard_model
    if not url:
        return None
    if not model:
        raise ConfigError("a guard URL needs a guard model name (--guard-model or BATON_SAFETY_GUARD_MODEL)")
    budget_ms = settings.guard_budget_ms if args.guard_budget_ms is None else args.guard_budget_ms
    return GuardConfig(url, model, settings.guard_api_key, budget_ms / 1000)


async def serve(config: SafetyServerConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = SafetyServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining for up to %.1f s", config.grace_s)
    await server.stop()


def run_safety_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from(args, SafetySettings())
        # OpenTelemetry's own variable (none | console | otlp): the server continues callers' traces.
        setup_tracing(os.environ.get("OTEL_TRACES_EXPORTER", "none"), "baton-safety")
        asyncio.run(serve(config))
    except (BatonError, ValidationError, OSError) as e:
        log.error("cannot run the safety service: %s", e)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.safety", description="Baton safety service")
    add_safety_arguments(parser)
    return run_safety_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
