"""`baton serve`: the whole cluster on this machine with one command.

Start order (each waits for the previous to be ready): Postgres, Redis and the Kafka-protocol broker
(embedded unless BATON_DATABASE_URL / BATON_REDIS_URL / BATON_KAFKA_BOOTSTRAP are set), the schema
and the first API key, the scheduler, one prefill and one decode worker (or one `both` worker with
`--workers-role both`), safety, the billing consumer, and the gateway on `--host:--port`
(127.0.0.1:8000) with its internal gRPC API on `--grpc-port` (default: the next port). Prints the URL
(and a newly created key, once) when everything is ready.

Ports: the two the user picks are checked before anything starts (a taken one fails at once, naming
the flag to change); every other port is picked free, so several clusters run side by side with
different `--port`s.

Supervision: a child (or embedded Postgres/Redis/broker) that dies is restarted with backoff on the
same ports while the rest keep serving (supervisor.py, cluster.py); its log tail is printed. The run
file `<run dir>/run.json` lists the live pids, ports and metrics endpoints (fault injection and
`baton status` read it; rundir.py says how `baton status --port` finds it).

Ctrl-C / SIGTERM during start-up stop what was started at once (`ABORT_GRACE_S`: nothing serves yet,
so nothing needs draining). Once ready, they stop everything in reverse order: the gateway stops
taking requests and drains its streams, then its outbox relay publishes the usage rows left
(services/billing/relay.py); then the
billing consumer drains the topic into the ledger; infrastructure (broker, Redis, Postgres) goes last.
Usage not yet billed at that point stays in the outbox table (or the usage spool under the run dir)
and is published by the next run's gateway when `--data-dir` keeps them. The run
dir (a temp dir unless `--data-dir`) is removed on every exit path but SIGKILL; see rundir.py.

Credentials: the internal gRPC ports (scheduler, workers, safety) ask for the cluster token,
`BATON_CLUSTER_TOKEN` or a new one per run, handed to every child in its environment; the embedded
Postgres and Redis get generated passwords, carried in the URLs the children get. The run file (mode
0600) holds them all for the operator's tools.

API key: `BATON_API_KEY` (a `bt-...` key) is registered for the organisation "local" if it is not
known yet; without it a key is created and printed once (with `--data-dir`, only on the first run).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import re
import signal
import sys
from pathlib import Path
from types import FrameType

from pydantic import ValidationError
from pydantic_settings import SettingsError

from scheduler.types import Tier
from services.billing.schema import migrate_billing
from services.common.cluster_auth import ClusterToken
from services.common.errors import BatonError, ConfigError, NotFoundError
from services.common.quantization_flags import add_quantization_args
from services.common.settings import TIERS, BatonSettings
from services.gateway.db.accounts import AccountStore
from services.gateway.db.api_keys import ApiKeyStore
from services.gateway.db.migrations import migrate_gateway
from services.gateway.db.pool import Database, DatabaseConfig
from services.gateway.tenancy.auth import KEY_PREFIX, display_prefix, hash_api_key
from services.launcher.builder import WORKER_READY
from services.launcher.cluster import LocalCluster, ServeOptions
from services.launcher.infra import EmbeddedInfra, InfraConfig, InfraEndpoints
from services.launcher.models import ModelSpec, check_unique
from services.launcher.process import PortInUseError, port_in_use, reserve_port
from services.launcher.rundir import Endpoint, RunDir, RunState
from services.launcher.supervisor import Supervisor

log = logging.getLogger("services.launcher.serve")
LOCAL_ORG = "local"
_KEY_RE = re.compile(r"^bt-[A-Za-z0-9_-]{43}$")
# Ctrl-C during start-up: each child gets its stop signal, and this long to exit before SIGKILL.
ABORT_GRACE_S = 1.0
__all__ = ["WORKER_READY", "ServeOptions", "register_serve_command", "serve"]


class ServeInterrupted(BaseException):
    """SIGINT/SIGTERM while starting: unwind and stop what was started."""


def register_serve_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `baton` console script (services/cli.py)."""
    p = subparsers.add_parser("serve", help="run the whole cluster locally (gateway on http://127.0.0.1:8000)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--workers-role", choices=["disaggregated", "both"], default="disaggregated",
                   help="one prefill + one decode worker (default), or one co-located 'both' worker")
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                   help="a served model: an HF dir, SmolLM2-135M-Instruct or baton-tiny-random, optionally named; "
                        "repeat for several (workers for each; the first is the default; "
                        "default: SmolLM2-135M-Instruct)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep Postgres data and logs here across runs (default: a temp dir, removed at exit)")
    p.add_argument("--tier", choices=list(TIERS), default="enterprise", help="tier of the local organisation")
    p.add_argument("--worker-threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split each worker's layers over this many processes (prefill and decode workers: "
                        "each stage hands its layers' KV to the decode worker's stage holding them)")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE models: shard each worker's experts over this many processes (needs --workers-role "
                        "both: every expert-parallel rank holds the whole KV cache)")
    add_quantization_args(p)
    p.add_argument("--host-kv-gib", type=float, default=0.0,
                   help="per worker: pinned host memory for KV evicted from the GPU pool (0: off)")
    p.add_argument("--disk-kv-dir", type=Path, default=None,
                   help="disk KV tier: each worker uses (and empties) a subdirectory named after it")
    p.add_argument("--disk-kv-gib", type=float, default=0.0, help="per worker: disk space for KV (0: off)")
    p.add_argument("--no-safety", action="store_true", help="do not start the safety service (unchecked!)")
    p.add_argument("--no-scheduler", action="store_true", help="route statically instead of via the scheduler")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="the gateway's internal gRPC API port (default: --port + 1)")
    p.add_argument("--no-grpc", action="store_true", help="do not serve the internal gRPC API")
    p.add_argument("--gateway-processes", type=int, default=1,
                   help="gateway processes sharing its port (one event loop streams ~7-8k tokens/s)")
    p.set_defaults(func=run_serve_command)


def _check_expert_parallel(args: argparse.Namespace) -> None:
    if args.expert_parallel_size < 1:
        raise ConfigError(f"--expert-parallel-size must be >= 1, got {args.expert_parallel_size}")
    if args.expert_parallel_size > 1 and args.workers_role != "both":
        raise ConfigError("--expert-parallel-size > 1 needs --workers-role both: every expert-parallel rank "
                          "holds the whole KV cache, which the KV link does not hand off")
    if args.expert_parallel_size > 1 and args.pipeline_parallel_size > 1:
        raise ConfigError("--expert-parallel-size and --pipeline-parallel-size do not combine")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    models = check_unique(tuple(ModelSpec.parse(m) for m in args.model or ()))
    if len(models) > 1 and args.no_scheduler:
        raise ConfigError("several --model need the scheduler: it routes each model to its own workers")
    grpc_port = None if args.no_grpc else args.port + 1 if args.grpc_port is None else args.grpc_port
    for flag, port in (("--port", args.port), ("--grpc-port", grpc_port)):
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"{flag} {port}: a port is 1..65535")
    if args.disk_kv_gib and args.disk_kv_dir is None:
        raise ConfigError("--disk-kv-gib needs --disk-kv-dir (the directory the workers' block files go to)")
    if args.pipeline_parallel_size < 1:
        raise ConfigError(f"--pipeline-parallel-size must be >= 1, got {args.pipeline_parallel_size}")
    _check_expert_parallel(args)
    if grpc_port == args.port:
        raise ConfigError(f"--grpc-port {grpc_port} is the gateway's --port; give each its own")
    return ServeOptions(host=args.host, port=args.port, workers_role=args.workers_role, models=models,
                        data_dir=args.data_dir, tier=args.tier, worker_threads=args.worker_threads,
                        num_blocks=args.num_blocks, pipeline_parallel_size=args.pipeline_parallel_size,
                        expert_parallel_size=args.expert_parallel_size, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, host_kv_gib=args.host_kv_gib,
                        disk_kv_dir=args.disk_kv_dir,
                        disk_kv_gib=args.disk_kv_gib, safety=not args.no_safety,
                        scheduler=not args.no_scheduler and _has_module("scheduler.adapters.main"),
                        grpc_port=grpc_port, gateway_processes=args.gateway_processes)


def check_gateway_ports(options: ServeOptions) -> None:
    """Fail before anything starts when a port the user chose is taken (e.g. by another `baton serve`):
    found only when the gateway binds it, it would cost every other child's start-up first."""
    flags = {"--port": options.port, "--grpc-port": options.grpc_port}
    for flag, port in flags.items():
        if port is not None and port_in_use(options.host, port):
            other = f" (`baton status --port {port}` says if by a Baton cluster)" if flag == "--port" else ""
            raise PortInUseError(f"port {port} on {options.host} ({flag}) is in use{other}; "
                                 f"choose another {flag}" + (" or --no-grpc" if flag == "--grpc-port" else ""))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def run_serve_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    try:
        settings = BatonSettings()
        options = options_from_args(args)
        api_key = os.environ.get("BATON_API_KEY") or None
        cluster_token = ClusterToken.from_environ(os.environ)
        if api_key is not None and not _KEY_RE.match(api_key):
            raise ConfigError(f"BATON_API_KEY must look like {KEY_PREFIX}<43 characters of [A-Za-z0-9_-]> "
                              "(as `baton admin create-key` makes)")
    except (BatonError, ValidationError, SettingsError) as e:
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    return serve(options, settings, api_key, cluster_token)


def serve(options: ServeOptions, settings: BatonSettings, api_key: str | None,
          cluster_token: ClusterToken | None = None) -> int:
    """Run until a signal (exit 0) or a child's death (exit 1); start failures exit 2.
    `cluster_token`: what the internal ports ask for (None: a new one for this run)."""
    cluster_token = cluster_token or ClusterToken.generate()
    try:
        check_gateway_ports(options)
    except PortInUseError as e:
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    for port in (options.port, options.grpc_port):  # no child is ever handed the gateway's ports
        if port is not None:
            reserve_port(port)
    stopping = _install_signal_handlers()
    run_dir = RunDir(options.data_dir)
    infra = EmbeddedInfra(InfraConfig.from_settings(settings, run_dir.path / "infra"))
    supervisor = Supervisor(run_dir.path / "logs", cwd=Path.cwd())
    run_file = _RunFile(options, run_dir, infra, supervisor)
    try:
        run_dir.publish(options.port)
        run_file.write()
        run_file.infra_endpoints = endpoints = infra.start()
        issued = _bootstrap_database(endpoints.database_url, api_key, options.tier)
        run_file.cluster = cluster = LocalCluster(options, endpoints, supervisor, cluster_token=cluster_token,
                                                  usage_spool_dir=run_dir.path / "usage-spool")
        supervisor.on_change = lambda s: run_file.write()
        for name, service in infra.embedded_by_name().items():
            supervisor.watch_service(name, service)
        cluster.prepare_model()
        cluster.start()
        run_file.write(RunState.READY)
        _announce(options, issued, supervisor.log_dir, run_dir)
        dead = supervisor.watch(lambda: stopping.is_set)
        if dead is not None:
            print(f"baton serve: {dead} exited; stopping. Its log:\n{supervisor.log_tail(dead)}", file=sys.stderr)
            return 1
        return 0
    except ServeInterrupted:
        return 0
    except BatonError as e:
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        stopping.set()
        print("baton serve: stopping...", file=sys.stderr, flush=True)
        try:
            ready = run_file.state is RunState.READY
            run_file.write(RunState.STOPPING)
            supervisor.stop_all(grace_s=None if ready else ABORT_GRACE_S)
            infra.stop()
        finally:
            run_dir.close()


class _RunFile:
    """What `<run dir>/run.json` says (rundir.py), rewritten as the cluster starts, changes and stops."""

    def __init__(self, options: ServeOptions, run_dir: RunDir, infra: EmbeddedInfra, supervisor: Supervisor) -> None:
        self.options, self.run_dir, self.infra, self.supervisor = options, run_dir, infra, supervisor
        self.state = RunState.STARTING
        self.infra_endpoints: InfraEndpoints | None = None
        self.cluster: LocalCluster | None = None

    def write(self, state: RunState | None = None) -> None:
        self.state = state or self.state
        s, cluster = self.supervisor, self.cluster
        ports = {name: service.port for name, service in self.infra.embedded_by_name().items()
                 if service.pid is not None}  # started once: a restart keeps the port
        content: dict[str, object] = {
            "state": self.state.value, "gateway": self.options.gateway_url, "grpc": self.options.grpc_target,
            "pids": s.pids(), "restarts": s.restarts(), "ports": {**ports, **(cluster.ports if cluster else {})},
            "endpoints": {**{name: {Endpoint.TCP: port} for name, port in ports.items()},
                          **(cluster.served if cluster else {})},
            "metrics": cluster.metrics_urls() if cluster else {}}
        if self.infra_endpoints is not None:
            infra = self.infra_endpoints
            content |= {"database_url": infra.database_url, "redis_url": infra.redis_url,
                        "kafka_bootstrap": infra.kafka_bootstrap}
        if cluster is not None:  # for the operator's tools (`baton scheduler`): the file is owner-only
            content["cluster_token"] = cluster.cluster_token.value
        try:
            self.run_dir.write_run_file(content)
        except OSError as e:
            log.warning("cannot write the run file %s: %s", self.run_dir.run_file, e)


class _Flag:
    def __init__(self) -> None:
        self.is_set = False
        self.watching = False

    def set(self) -> None:
        self.is_set = True


def _install_signal_handlers() -> _Flag:
    flag = _Flag()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if flag.is_set:
            return  # already stopping: a second Ctrl-C must not interrupt the ordered shutdown
        flag.set()
        raise ServeInterrupted()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return flag


def _announce(options: ServeOptions, issued: str | None, log_dir: Path, run_dir: RunDir) -> None:
    lines = [f"Baton is ready: {options.gateway_url}  (chat page at /, OpenAI API at /v1)",
             f"logs: {log_dir}", f"run file (pids, ports): {run_dir.run_file}",
             f"status: baton status --port {options.port}"]
    if options.grpc_target:
        lines.insert(1, f"gRPC API: {options.grpc_target}  (baton api chat \"Hello\"; services.client.BatonClient)")
    if issued:
        lines.append(f"API key (shown once, store it now): {issued}")
    print("\n".join(lines), flush=True)


def _bootstrap_database(database_url: str, api_key: str | None, tier: Tier) -> str | None:
    """Migrate, make sure the local organisation and a key exist; returns a newly created key."""
    migrate_database(database_url)
    return asyncio.run(ensure_api_key(database_url, api_key, tier))


def migrate_database(database_url: str) -> None:
    """Every owner's tables: the gateway's and billing's (each also migrates its own at start)."""
    migrate_gateway(database_url)
    migrate_billing(database_url)


async def ensure_api_key(database_url: str, api_key: str | None, tier: Tier = Tier.ENTERPRISE) -> str | None:
    """Register `api_key` for the local organisation, or create one if it has none; returns a new key."""
    from services.gateway.tenancy.auth import ApiKeyAuthenticator

    async with Database(DatabaseConfig(database_url, min_size=1, max_size=2, migrate=False)) as db:
        accounts, keys = AccountStore(db), ApiKeyStore(db)
        try:
            org = await accounts.find_org(LOCAL_ORG)
        except NotFoundError:
            org = await accounts.create_org(LOCAL_ORG, tier)
        if api_key is not None:
            if await keys.find_by_hash(hash_api_key(api_key)) is None:
                await keys.insert(org.id, hash_api_key(api_key), display_prefix(api_key), user_id=None,
                                  name="BATON_API_KEY", rpm_limit=None, tpm_limit=None)
            return None
        if any(not k.revoked for k in await keys.list_for_org(org.id)):
            log.info("the local organisation already has keys; make another with `baton admin create-key`")
            return None
        return (await ApiKeyAuthenticator(keys).issue(org.id, name="baton serve")).key
