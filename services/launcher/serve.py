"""`baton serve`: the whole cluster on this machine with one command.

Start order (each waits for the previous to be ready): Postgres, Redis and the Kafka-protocol broker
(embedded unless BATON_DATABASE_URL / BATON_REDIS_URL / BATON_KAFKA_BOOTSTRAP are set), the schema
and the first API key, the scheduler, one prefill and one decode worker (or one `both` worker with
`--workers-role both`), safety, the billing consumer, and the gateway on `--host:--port`
(127.0.0.1:8000). Prints the URL (and a newly created key, once) when everything is ready.

Ctrl-C / SIGTERM stop everything in reverse order: the gateway drains first, infrastructure goes
last. A child that dies on its own stops the cluster too (exit code 1), with its log tail printed.

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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pydantic import ValidationError
from pydantic_settings import SettingsError

from services.common.errors import BatonError, ConfigError, NotFoundError
from services.common.settings import TIERS, BatonSettings, Tier
from services.gateway.auth import KEY_PREFIX, display_prefix, hash_api_key
from services.gateway.db.accounts import AccountStore
from services.gateway.db.api_keys import ApiKeyStore
from services.gateway.db.migrations import apply_migrations
from services.gateway.db.pool import Database, DatabaseConfig
from services.launcher.infra import EmbeddedInfra, InfraConfig, InfraEndpoints
from services.launcher.process import free_port
from services.launcher.supervisor import ChildSpec, Supervisor, http_ok, listening, log_line

log = logging.getLogger("services.launcher.serve")
LOCAL_ORG = "local"
_KEY_RE = re.compile(r"^bt-[A-Za-z0-9_-]{43}$")
WORKER_READY = "BATON_WORKER_READY"


class ServeInterrupted(BaseException):
    """SIGINT/SIGTERM while starting: unwind and stop what was started."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    workers_role: str = "disaggregated"  # "disaggregated" (prefill + decode) | "both" (one co-located)
    model: str | None = None  # None: the default model (prepared on first use)
    data_dir: Path | None = None  # None: a temp dir, removed at exit
    tier: Tier = "enterprise"  # the local organisation's tier
    worker_threads: int = 1  # torch CPU threads per worker
    num_blocks: int | None = None  # KV blocks per worker (None: the engine's default)
    safety: bool = True
    scheduler: bool = True

    @property
    def gateway_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


def register_serve_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `baton` console script (services/cli.py)."""
    p = subparsers.add_parser("serve", help="run the whole cluster locally (gateway on http://127.0.0.1:8000)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--workers-role", choices=["disaggregated", "both"], default="disaggregated",
                   help="one prefill + one decode worker (default), or one co-located 'both' worker")
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="keep Postgres data and logs here across runs (default: a temp dir, removed at exit)")
    p.add_argument("--tier", choices=list(TIERS), default="enterprise", help="tier of the local organisation")
    p.add_argument("--worker-threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--no-safety", action="store_true", help="do not start the safety service (unchecked!)")
    p.add_argument("--no-scheduler", action="store_true", help="route statically instead of via the scheduler")
    p.set_defaults(func=run_serve_command)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, workers_role=args.workers_role, model=args.model,
                        data_dir=args.data_dir, tier=args.tier, worker_threads=args.worker_threads,
                        num_blocks=args.num_blocks, safety=not args.no_safety,
                        scheduler=not args.no_scheduler and _has_module("scheduler.adapters.main"))


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
        if api_key is not None and not _KEY_RE.match(api_key):
            raise ConfigError(f"BATON_API_KEY must look like {KEY_PREFIX}<43 characters of [A-Za-z0-9_-]> "
                              "(as `baton admin create-key` makes)")
    except (BatonError, ValidationError, SettingsError) as e:
        print(f"baton serve: error: {e}", file=sys.stderr)
        return 2
    return serve(options, settings, api_key)


def serve(options: ServeOptions, settings: BatonSettings, api_key: str | None) -> int:
    """Run until a signal (exit 0) or a child's death (exit 1); start failures exit 2."""
    work_dir = options.data_dir or Path(tempfile.mkdtemp(prefix="baton-serve-"))
    infra = EmbeddedInfra(InfraConfig.from_settings(settings, work_dir / "infra" if options.data_dir else None))
    supervisor = Supervisor(work_dir / "logs", cwd=Path.cwd())
    stopping = _install_signal_handlers()
    try:
        endpoints = infra.start()
        issued = _bootstrap_database(endpoints.database_url, api_key, options.tier)
        cluster = LocalCluster(options, endpoints, supervisor)
        cluster.prepare_model()
        cluster.start()
        _announce(options, issued, supervisor.log_dir)
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
        supervisor.stop_all()
        infra.stop()
        if options.data_dir is None:
            import shutil

            shutil.rmtree(work_dir, ignore_errors=True)


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


def _announce(options: ServeOptions, issued: str | None, log_dir: Path) -> None:
    lines = [f"Baton is ready: {options.gateway_url}  (chat page at /, OpenAI API at /v1)",
             f"logs: {log_dir}"]
    if issued:
        lines.append(f"API key (shown once, store it now): {issued}")
    print("\n".join(lines), flush=True)


def _bootstrap_database(database_url: str, api_key: str | None, tier: Tier) -> str | None:
    """Migrate, make sure the local organisation and a key exist; returns a newly created key."""
    apply_migrations(database_url)
    return asyncio.run(ensure_api_key(database_url, api_key, tier))


async def ensure_api_key(database_url: str, api_key: str | None, tier: Tier = "enterprise") -> str | None:
    """Register `api_key` for the local organisation, or create one if it has none; returns a new key."""
    from services.gateway.auth import ApiKeyAuthenticator

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


class LocalCluster:
    """The child processes of one `baton serve`, as supervisor specs."""

    def __init__(self, options: ServeOptions, endpoints: InfraEndpoints, supervisor: Supervisor) -> None:
        self.options = options
        self.endpoints = endpoints
        self.supervisor = supervisor
        self.python = sys.executable
        self.infra_env = {"BATON_DATABASE_URL": endpoints.database_url, "BATON_REDIS_URL": endpoints.redis_url,
                          "BATON_KAFKA_BOOTSTRAP": endpoints.kafka_bootstrap}

    def prepare_model(self) -> None:
        """Convert the default model once (in a child: the launcher itself never imports torch)."""
        if self.options.model is not None:
            return
        self.supervisor.run_once("prepare-model", [
            self.python, "-c", "from engine.loader.prepare import default_model_dir as d; print(d())"], 600)

    def start(self) -> None:
        scheduler = self._start_scheduler() if self.options.scheduler else None
        decode = self._start_workers(scheduler)
        safety = self._start_safety() if self.options.safety else None
        self.supervisor.start(ChildSpec("billing", [self.python, "-m", "services.billing"],
                                        log_line("billing consumer:"), env=self.infra_env))
        self._start_gateway(scheduler, decode, safety)

    def _start_scheduler(self) -> str:
        port = free_port()
        self.supervisor.start(ChildSpec("scheduler", [self.python, "-m", "scheduler.adapters", "--host", "127.0.0.1",
                                                      "--port", str(port)], listening(port)))
        return f"127.0.0.1:{port}"

    def _worker(self, role: str, scheduler: str | None, extra: list[str]) -> str:
        port = free_port()
        argv = [self.python, "-m", "services.worker", "--role", role, "--host", "127.0.0.1", "--port", str(port),
                "--torch-threads", str(self.options.worker_threads), *extra]
        if self.options.model:
            argv += ["--model", self.options.model]
        if self.options.num_blocks:
            argv += ["--num-blocks", str(self.options.num_blocks)]
        if scheduler:
            argv += ["--scheduler", scheduler]
        self.supervisor.start(ChildSpec(f"worker-{role}", argv, log_line(WORKER_READY), ready_timeout_s=300))
        return f"127.0.0.1:{port}"

    def _start_workers(self, scheduler: str | None) -> str:
        """The decode-capable worker's address."""
        if self.options.workers_role == "both":
            return self._worker("both", scheduler, [])
        prefill = self._worker("prefill", scheduler, [])
        return self._worker("decode", scheduler, ["--prefill-peers", prefill])

    def _start_safety(self) -> str:
        port = free_port()
        self.supervisor.start(ChildSpec("safety", [self.python, "-m", "services.safety", "--host", "127.0.0.1",
                                                   "--port", str(port)], listening(port)))
        return f"127.0.0.1:{port}"

    def _start_gateway(self, scheduler: str | None, decode: str, safety: str | None) -> None:
        o = self.options
        env = {**self.infra_env, "BATON_WORKER_ADDRESSES": f'["{decode}"]'}
        if scheduler:
            env["BATON_SCHEDULER_ADDRESS"] = scheduler
        if safety:
            env["BATON_SAFETY_ADDRESS"] = safety
        if o.model:
            env["BATON_MODEL"] = o.model
        self.supervisor.start(ChildSpec(
            "gateway", [self.python, "-m", "services.gateway", "--host", o.host, "--port", str(o.port)],
            http_ok(f"{o.gateway_url}/readyz"), env=env, stop_timeout_s=40))
