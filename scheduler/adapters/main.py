"""`baton scheduler` / `python -m scheduler.adapters`: the scheduler service's main.

services/cli.py wires the subcommand with `register_scheduler_command(sub)`. Flags are this
service's whole configuration (the Helm chart passes them as args); nothing below main reads the
environment. SIGTERM and SIGINT drain the service (see server.py) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from scheduler.adapters.admin import add_admin_commands
from scheduler.adapters.loop_watch import settle_gc
from scheduler.adapters.server import DEFAULT_PORT, SchedulerService, SchedulerServiceConfig
from scheduler.adapters.servicer import ServicerConfig
from scheduler.core.policies import POLICY_NAMES
from scheduler.native import check_fresh
from scheduler.types import Tier
from services.common.cluster_auth import ClusterToken
from services.common.tracing import EXPORTERS, setup_tracing
from tokenization.errors import ConfigError

log = logging.getLogger("scheduler.adapters")


DEGRADE_FRACTION_ENV = "BATON_SCHEDULER_DEGRADE_FRACTION"
DEGRADE_TIERS_ENV = "BATON_SCHEDULER_DEGRADE_TIERS"
DEGRADE_MODELS_ENV = "BATON_SCHEDULER_DEGRADE_MODELS"


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (gRPC and metrics)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT})")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="goodput", help="routing policy")
    parser.add_argument(
        "--profile", default=None, metavar="FILE",
        help="cost-model seed: a `baton profile` JSON, or {model: profile, '*': profile}",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    parser.add_argument("--heartbeat-interval-s", type=float, default=ServicerConfig.heartbeat_interval_s)
    parser.add_argument(
        "--heartbeat-timeout-s", type=float, default=SchedulerServiceConfig.heartbeat_timeout_s,
        help="a worker silent this long is dropped and never routed to",
    )
    parser.add_argument("--tick-interval-s", type=float, default=ServicerConfig.tick_interval_s)
    parser.add_argument("--drain-grace-s", type=float, default=SchedulerServiceConfig.drain_grace_s)
    parser.add_argument(
        "--degrade-fraction", type=float, default=None,
        help="goodput policy under overload: serve the degradable tiers with max_tokens x this (0-1) "
             f"instead of queueing them (default ${DEGRADE_FRACTION_ENV}, else off)",
    )
    parser.add_argument(
        "--degrade-tiers", default=None,
        help=f"comma-separated tiers that may be degraded (default ${DEGRADE_TIERS_ENV}, else free)",
    )
    parser.add_argument(
        "--degrade-model", action="append", default=None, metavar="MODEL=FALLBACK",
        help="goodput policy under overload: serve the degradable tiers' MODEL requests on FALLBACK (a smaller "
             "model with the same tokenizer) before a shorter max_tokens; repeatable "
             f"(default ${DEGRADE_MODELS_ENV}, comma-separated pairs, else none)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--otel-exporter", default="none", choices=EXPORTERS,
                        help="where spans go (otlp: OTEL_EXPORTER_OTLP_ENDPOINT, default localhost:4317)")


def register_scheduler_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `scheduler` to a `baton` subparsers object; the handler returns the exit code."""
    parser = subparsers.add_parser(
        "scheduler", help="run the goodput-aware scheduler service (gRPC), or operate a running one"
    )
    add_scheduler_arguments(parser)
    parser.set_defaults(func=run_scheduler)
    add_admin_commands(parser)
    return parser


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> SchedulerServiceConfig:
    env = os.environ if environ is None else environ
    fraction = args.degrade_fraction
    if fraction is None and env.get(DEGRADE_FRACTION_ENV):
        fraction = _parse_fraction(env[DEGRADE_FRACTION_ENV])
    tiers = args.degrade_tiers or env.get(DEGRADE_TIERS_ENV) or Tier.FREE.value
    model_pairs = args.degrade_model or [p for p in env.get(DEGRADE_MODELS_ENV, "").split(",") if p.strip()]
    return SchedulerServiceConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        profile_path=args.profile,
        metrics_port=args.metrics_port,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        drain_grace_s=args.drain_grace_s,
        degrade_fraction=fraction,
        degrade_tiers=_parse_tiers(tiers),
        degrade_models=_parse_model_pairs(model_pairs),
        servicer=ServicerConfig(heartbeat_interval_s=args.heartbeat_interval_s, tick_interval_s=args.tick_interval_s),
        cluster_token=ClusterToken.from_environ(env),
    )


def _parse_fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{DEGRADE_FRACTION_ENV}={text!r} is not a number in (0, 1)") from None


def _parse_model_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """["big=small", ...] -> {"big": "small"}; one fallback per model."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        big, sep, small = (part.strip() for part in pair.partition("="))
        if not sep or not big or not small or big in mapping:
            raise ValueError(f"degrade model {pair!r}: expected MODEL=FALLBACK, one per model")
        mapping[big] = small
    return mapping


def _parse_tiers(text: str) -> frozenset[Tier]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    valid = ", ".join(t.value for t in Tier)
    unknown = [n for n in names if n not in {t.value for t in Tier}]
    if unknown or not names:
        raise ValueError(f"degrade tiers {unknown or text!r}: valid tiers are {valid}")
    return frozenset(Tier(n) for n in names)


def run_scheduler(args: argparse.Namespace) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level)
    try:
        check_fresh()  # a compiled module older than its source would run instead of it (scheduler/native.py)
        config = config_from_args(args)
        service = SchedulerService(config)  # loads the profile file: a bad one fails here, clearly
        setup_tracing(args.otel_exporter, "baton-scheduler")
    except (ValueError, ConfigError) as e:
        print(f"baton scheduler: error: {e}", file=sys.stderr)
        return 2
    settle_gc()  # garbage collections out of the p99 of routing decisions (loop_watch.py)
    try:
        asyncio.run(_serve(service))
    except OSError as e:
        print(f"baton scheduler: error: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(service: SchedulerService) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, signum, stop)
    await service.serve(stop)


def _on_signal(signum: int, stop: asyncio.Event) -> None:
    log.info("signal %d: draining", signum)
    stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.adapters", description="Baton scheduler service")
    add_scheduler_arguments(parser)
    return run_scheduler(parser.parse_args(argv))
