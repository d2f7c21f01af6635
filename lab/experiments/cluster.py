"""The local cluster an experiment runs against, one fresh stack per policy, on shared infrastructure.

`ExperimentInfra` starts Postgres, Redis and the Kafka-protocol broker once (services/launcher's
`EmbeddedInfra`), applies the schema and creates one organisation per tier with one API key each.
`PolicyStack` starts, per policy run, the pieces `baton serve` starts, through the same cluster builder
(services/launcher/builder.py), with the differences an experiment needs:
- the scheduler is `lab.experiments.scheduler_tap` (the real service plus a record of its
  inputs for the simulator);
- several `both` workers with their own flags (heterogeneous on purpose), each registering with it;
- no safety service and no billing consumer (they would only take CPU from the workers on a
  2-core machine; usage events still go to the broker);
- tier SLOs and raised tier rate limits in the gateway's environment, so admission is decided by
  the scheduler, not by the gateway's RPM limits.
Every run gets fresh workers (empty prefix caches, cost models learnt from scratch).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from scheduler.types import WorkerRole
from services.common.cluster_auth import ClusterToken
from services.gateway.db.accounts import AccountStore
from services.gateway.db.api_keys import ApiKeyStore
from services.gateway.db.pool import Database, DatabaseConfig
from services.gateway.tenancy.auth import ApiKeyAuthenticator
from services.launcher.builder import ClusterSpec, GatewaySpec, SchedulerSpec, start_cluster
from services.launcher.fleet import WorkerPlan
from services.launcher.infra import EmbeddedInfra, InfraConfig, InfraEndpoints
from services.launcher.serve import migrate_database
from services.launcher.supervisor import Supervisor

TIERS = ("free", "plus", "enterprise")
# High enough that the gateway never rate-limits an experiment: admission is the scheduler's job here.
_UNLIMITED = {"key_rpm": 1_000_000, "key_tpm": 100_000_000, "org_rpm": 1_000_000, "org_tpm": 100_000_000}


@dataclass(frozen=True)
class WorkerFlags:
    name: str  # also its worker id at the scheduler
    max_num_seqs: int
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackConfig:
    policy: str
    workers: tuple[WorkerFlags, ...]
    slos: dict[str, tuple[float, float]]  # tier -> (ttft_ms, tpot_ms), what the gateway sends
    num_blocks: int = 384
    torch_threads: int = 1
    heartbeat_interval_s: float = 0.2
    # The scheduler's default (3 s) drops a `both` worker whose CPU steps run long: its heartbeat
    # waits for two step boundaries on the engine thread. A dropped worker re-registers with a
    # fresh cost model and an empty prefix index, which would blur every policy comparison.
    heartbeat_timeout_s: float = 10.0
    profile_path: Path | None = None  # seeds the scheduler's cost models (`--profile`)
    extra_gateway_env: dict[str, str] = field(default_factory=dict)


class ExperimentInfra:
    """Infrastructure plus one API key per tier (`keys[tier]`); a context manager."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.infra = EmbeddedInfra(InfraConfig())
        self.endpoints: InfraEndpoints | None = None
        self.keys: dict[str, str] = {}

    def __enter__(self) -> ExperimentInfra:
        self.endpoints = self.infra.start()
        try:
            migrate_database(self.endpoints.database_url)
            self.keys = asyncio.run(_issue_keys(self.endpoints.database_url))
        except BaseException:
            self.infra.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.infra.stop()


async def _issue_keys(database_url: str) -> dict[str, str]:
    async with Database(DatabaseConfig(database_url, min_size=1, max_size=2, migrate=False)) as db:
        accounts, auth = AccountStore(db), ApiKeyAuthenticator(ApiKeyStore(db))
        keys = {}
        for tier in TIERS:
            org = await accounts.create_org(f"experiment-{tier}", tier)  # type: ignore[arg-type]
            keys[tier] = (await auth.issue(org.id, name=f"experiment {tier}")).key
        return keys


class PolicyStack:
    """Scheduler (tapped), workers and gateway for one run; `url` once entered, tap file after exit."""

    def __init__(self, config: StackConfig, infra: ExperimentInfra, run_dir: Path) -> None:
        self.config = config
        self.infra = infra
        self.run_dir = run_dir
        self.tap_path = run_dir / "scheduler_tap.json"
        self.supervisor = Supervisor(run_dir / "logs", cwd=Path.cwd())
        self.url = ""  # the gateway's, set once it listens

    def __enter__(self) -> PolicyStack:
        url = start_cluster(self.cluster_spec(), self.supervisor, ClusterToken.generate()).gateway_url
        assert url is not None
        self.url = url
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.supervisor.stop_all()  # the scheduler stops last and writes the tap file

    def log_text(self, name: str) -> str:
        path = self.supervisor.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cluster_spec(self) -> ClusterSpec:
        """The gateway's port is picked as it starts, not with the stack: picked first, it was taken by
        some other socket during the workers' start-up once, and a bind race gets a fresh port rather
        than failing the whole experiment."""
        c, e = self.config, self.infra.endpoints
        assert e is not None, "ExperimentInfra must be entered first"
        scheduler = SchedulerSpec(module="lab.experiments.scheduler_tap", args=(
            "--policy", c.policy, "--tap-out", str(self.tap_path),
            "--heartbeat-interval-s", str(c.heartbeat_interval_s),
            "--heartbeat-timeout-s", str(c.heartbeat_timeout_s), "--drain-grace-s", "1",
            *(("--profile", str(c.profile_path)) if c.profile_path is not None else ())), stop_timeout_s=30)
        workers = tuple(WorkerPlan(w.name, WorkerRole.BOTH, (
            "--torch-threads", str(c.torch_threads), "--num-blocks", str(c.num_blocks),
            "--max-num-seqs", str(w.max_num_seqs), "--drain-grace-s", "2", *w.extra), worker_id=True)
            for w in c.workers)
        slos = {tier: {"ttft_ms": t, "tpot_ms": p} for tier, (t, p) in c.slos.items()}
        limits = dict.fromkeys(TIERS, _UNLIMITED)
        gateway_env = {"BATON_SLOS": json.dumps(slos), "BATON_TIER_LIMITS": json.dumps(limits),
                       "BATON_DRAIN_TIMEOUT_S": "2", **c.extra_gateway_env}
        return ClusterSpec(workers, infra=e, scheduler=scheduler,
                           gateway=GatewaySpec(env=gateway_env, stop_timeout_s=20))
