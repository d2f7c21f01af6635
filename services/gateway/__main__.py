"""`python -m services.gateway`: the OpenAI-compatible HTTP gateway.

The only place the gateway reads its environment: `BatonSettings` (database, Redis, Kafka, pricing,
tier limits) and `GatewaySettings` (auth mode, scheduler or static workers, safety, model, SSE).
`BATON_AUTH_MODE=none` builds the gateway without tenants (no Postgres, Redis or Kafka; see
tenancy.py) and says so loudly at start. The clients are
built inside the server's event loop (gRPC aio channels belong to the loop that made them), then
handed to `create_app`, with the internal gRPC API when `--grpc-port` / `BATON_GRPC_PORT` is set (same
clients, same event loop; grpc_api/). SIGTERM/SIGINT drain: the listener closes, running streams get
`BATON_DRAIN_TIMEOUT_S` to finish, then what is left is aborted (KV freed, usage billed).
`--processes N` / `BATON_GATEWAY_PROCESSES`: N replicas of this on the one port (replicas.py); this
process then only supervises them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from scheduler.adapters.loop_watch import settle_gc
from services.common.cluster_auth import ClusterToken
from services.common.errors import BatonError, ConfigError
from services.common.settings import BatonSettings
from services.gateway.app import create_app
from services.gateway.completions.generation import WorkerClient
from services.gateway.completions.safety_gate import SafetyGate
from services.gateway.config import GatewayConfig
from services.gateway.deps import GatewayDeps
from services.gateway.grpc_api.server import GrpcApiConfig, GrpcApiServer
from services.gateway.header_limit import header_limited_protocol
from services.gateway.replicas import reuse_port_socket, run_replicas
from services.gateway.routing.last_view import StaticWorkers
from services.gateway.routing.router_client import RouterClient
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.backends import TenantServices, build_open_tenancy, build_platform_tenancy
from services.gateway.tracing import setup_tracing
from tokenization.tokenizer import Tokenizer

log = logging.getLogger("services.gateway")


def build_tenancy(gw: GatewaySettings, settings: BatonSettings) -> TenantServices:
    if gw.auth_mode == "none":
        log.warning("!" * 100)
        log.warning("BATON_AUTH_MODE=none: NO API key is checked, NO rate limits, budgets or billing, NO conversation "
                    "storage; every request is one anonymous '%s' organisation. For benchmarks and single-user "
                    "development only: never expose this gateway to a network.", gw.anonymous_tier)
        log.warning("!" * 100)
        return build_open_tenancy(gw.anonymous_tier)
    return build_platform_tenancy(settings)


def build_deps(config: GatewayConfig, gw: GatewaySettings, settings: BatonSettings) -> GatewayDeps:
    """Every client from settings; call inside the running event loop."""
    if not gw.scheduler_address and not gw.worker_addresses:
        raise ConfigError("no workers: set BATON_SCHEDULER_ADDRESS or BATON_WORKER_ADDRESSES")
    # BATON_WORKER_ADDRESSES serve the default model; extra models are found through the scheduler.
    static = StaticWorkers(tuple(gw.worker_addresses), model=config.model.name) if gw.worker_addresses else None
    token = None if gw.cluster_token is None else ClusterToken(gw.cluster_token.get_secret_value())
    safety: SafetyGate | None = None
    if gw.safety_address:
        from services.safety.client import SafetyClient

        safety = SafetyGate(SafetyClient(gw.safety_address, cluster_token=token))
    else:
        log.warning("BATON_SAFETY_ADDRESS unset: prompts and outputs are NOT safety-checked")
    return GatewayDeps(config=config, tokenizer=Tokenizer.from_dir(config.model.path),
                       router=RouterClient(gw.scheduler_address, static, cluster_token=token),
                       workers=WorkerClient(cluster_token=token), tenancy=build_tenancy(gw, settings),
                       safety=safety, stream_redis_url=settings.redis_url,
                       extra_tokenizers={m.name: Tokenizer.from_dir(m.path) for m in config.extra_models})


async def serve(host: str, port: int, config: GatewayConfig, gw: GatewaySettings, settings: BatonSettings,
                grpc_api: GrpcApiConfig | None = None, replica: int | None = None) -> None:
    """`replica`: this process is replica `replica` of several on the port (replicas.py)."""
    deps = build_deps(config, gw, settings)
    app = create_app(deps, None if grpc_api is None else GrpcApiServer(deps, grpc_api), replica)
    settle_gc()  # fewer, cheaper collections on the loop every token crosses (scheduler/adapters/loop_watch.py)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, http=header_limited_protocol(config.max_header_bytes), lifespan="on",
        log_level=gw.log_level.lower(), access_log=False,
        timeout_graceful_shutdown=int(max(1, config.drain_timeout_s)), timeout_keep_alive=30))
    await server.serve(sockets=None if replica is None else [reuse_port_socket(host, port)])
    if not server.started:  # e.g. the port was taken, or the lifespan failed (database unreachable)
        raise ConfigError(f"the gateway did not start on {host}:{port}")


def supervise(args: argparse.Namespace, processes: int, drain_timeout_s: float) -> int:
    """This process runs `processes` replicas of the gateway on its port (they read the same settings)."""
    if args.port == 0:
        raise ConfigError("--processes > 1 needs a fixed --port (with port 0 each replica would take another)")
    argv = [sys.executable, "-m", "services.gateway", "--host", args.host, "--port", str(args.port)]
    if args.grpc_port is not None:
        argv += ["--grpc-port", str(args.grpc_port)]
    log.info("gateway: %d processes on %s:%d", processes, args.host, args.port)
    return run_replicas(processes, argv, drain_timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="serve the internal gRPC API on this port too (default: BATON_GRPC_PORT; unset: off)")
    parser.add_argument("--processes", type=int, default=None,
                        help="gateway processes sharing the port (default: BATON_GATEWAY_PROCESSES, else 1)")
    parser.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)  # set by the supervisor
    args = parser.parse_args(argv)
    try:
        settings, gw = BatonSettings(), GatewaySettings()
        logging.basicConfig(level=gw.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = GatewayConfig.from_settings(gw, settings)
        processes = args.processes if args.processes is not None else gw.gateway_processes
        if processes > 1 and args.replica is None:
            return supervise(args, processes, config.drain_timeout_s)
        setup_tracing(gw.otel_exporter)
        # uvicorn drains on SIGTERM, then re-raises it into the handler that was there before: make
        # that one a no-op, so a completed drain exits 0 instead of dying of the signal.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        grpc_port = args.grpc_port if args.grpc_port is not None else gw.grpc_port
        grpc_api = None if grpc_port is None else replace(
            GrpcApiConfig.from_paths(args.host, grpc_port, gw.grpc_tls_cert, gw.grpc_tls_key),
            shared_port=args.replica is not None)
        asyncio.run(serve(args.host, args.port, config, gw, settings, grpc_api, args.replica))
    except (BatonError, ValidationError, SettingsError) as e:
        print(f"gateway: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
