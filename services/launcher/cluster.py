"""`LocalCluster`: the child processes of one `baton serve`, as a `ClusterSpec` for the builder (builder.py).

Every child gets a `RestartPolicy`: when it dies, the supervisor restarts it with the same command
line, so it comes back on the same ports and the others find it again (the gateway's static decode
address and the decode worker's prefill peer stay valid; workers re-register with a restarted
scheduler). While the prefill worker is down the decode worker prefills locally (its
`prefill_unavailable` fallback), so the cluster keeps serving.

Ports: each child's ports are picked by the builder once and kept (picked again only when the child
lost one before binding it, e.g. to another `baton serve` starting at the same time); the gateway's
requested ports are reserved (`reserve_port`) so no child is ever handed them. Every child serves
Prometheus metrics: the gateway on its HTTP port, every other child on a port of its own.

Workers: per served model, one prefill and one decode worker (`Layout(1, 1)`), or one `both` worker
(`Layout(0, 1)`); the default model's keep the plain names (`worker-decode`: run.json, fault
injection), another model's carry its name (`worker-<model>-decode`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from scheduler.planner import Layout
from scheduler.types import Tier
from services.common.cluster_auth import ClusterToken
from services.common.quantization_flags import quantization_worker_args
from services.launcher.builder import (
    BillingSpec,
    ClusterBuilder,
    ClusterSpec,
    GatewaySpec,
    SafetySpec,
    SchedulerSpec,
)
from services.launcher.fleet import RoleArgs, WorkerFleet, WorkerPlan
from services.launcher.infra import InfraEndpoints
from services.launcher.models import ModelSpec
from services.launcher.rundir import Endpoint
from services.launcher.supervisor import RestartPolicy, Supervisor


def parallel_worker_args(options: ServeOptions) -> list[str]:
    """`baton worker` flags of the workers' parallel layout (none for one process per worker)."""
    pp, ep = options.pipeline_parallel_size, options.expert_parallel_size
    return ((["--pipeline-parallel-size", str(pp)] if pp > 1 else [])
            + (["--expert-parallel-size", str(ep)] if ep > 1 else []))


def kv_tier_worker_args(options: ServeOptions, worker_name: str) -> list[str]:
    """The `baton worker` KV-tier flags of one worker: its own disk subdirectory, the same sizes."""
    argv = ["--host-kv-gib", str(options.host_kv_gib)] if options.host_kv_gib else []
    if options.disk_kv_dir is not None and options.disk_kv_gib:
        argv += ["--disk-kv-dir", str(options.disk_kv_dir / worker_name), "--disk-kv-gib", str(options.disk_kv_gib)]
    return argv


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    workers_role: str = "disaggregated"  # "disaggregated" (prefill + decode) | "both" (one co-located)
    # The served models, the default model first; empty: the default model (prepared on first use).
    models: tuple[ModelSpec, ...] = ()
    data_dir: Path | None = None  # None: a temp dir, removed at exit
    tier: Tier = Tier.ENTERPRISE  # the local organisation's tier
    worker_threads: int = 1  # torch CPU threads per worker
    num_blocks: int | None = None  # KV blocks per worker (None: the engine's default)
    pipeline_parallel_size: int = 1  # stages per worker (`baton worker --pipeline-parallel-size`)
    expert_parallel_size: int = 1  # MoE: expert-sharded ranks per worker (`baton worker --expert-parallel-size`)
    quantization: str | None = None  # every worker's `--quantization` (None: as the checkpoint is)
    kv_cache_dtype: str = "auto"  # every worker's `--kv-cache-dtype`: prefill and decode must agree
    # KV tiers per worker (`baton worker --host-kv-gib/--disk-kv-dir/--disk-kv-gib`); each worker gets
    # its own subdirectory of disk_kv_dir (a worker empties its directory at start-up).
    host_kv_gib: float = 0.0
    disk_kv_dir: Path | None = None
    disk_kv_gib: float = 0.0
    safety: bool = True
    scheduler: bool = True
    grpc_port: int | None = 8001  # the gateway's internal gRPC API (services/gateway/grpc_api); None: off
    gateway_processes: int = 1  # gateway processes on its port (services/gateway/replicas.py)

    @property
    def gateway_url(self) -> str:
        return f"http://{self._reachable_host}:{self.port}"

    @property
    def grpc_target(self) -> str | None:
        return None if self.grpc_port is None else f"{self._reachable_host}:{self.grpc_port}"

    @property
    def _reachable_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host


class LocalCluster:
    def __init__(self, options: ServeOptions, endpoints: InfraEndpoints, supervisor: Supervisor, *,
                 cluster_token: ClusterToken, restart: RestartPolicy | None = None,
                 usage_spool_dir: Path | None = None) -> None:
        """`usage_spool_dir`: where the gateway spools usage while Postgres is down (None: its default).
        `cluster_token`: every child gets it (BATON_CLUSTER_TOKEN): the internal ports ask for it."""
        self.options = options
        self.cluster_token = cluster_token
        self.supervisor = supervisor
        self.python = sys.executable
        spec = serve_cluster_spec(options, endpoints, restart or RestartPolicy(), usage_spool_dir)
        self.builder = ClusterBuilder(spec, supervisor, cluster_token, self.python)

    @property
    def ports(self) -> dict[str, int]:
        """"<child>", "<child>-metrics" and "gateway-grpc" -> port (fault injection reads these)."""
        return self.builder.ports

    @property
    def served(self) -> dict[str, dict[Endpoint, int]]:
        """Child -> what it serves on which port (the run file's `endpoints`)."""
        return self.builder.served

    def prepare_model(self) -> None:
        """Prepare the built-in models once (in a child: the launcher itself never imports torch)."""
        builtins = [s.source for s in self.options.models if s.builtin] or ([] if self.options.models else [""])
        for source in dict.fromkeys(builtins):
            self.supervisor.run_once(f"prepare-{source or 'model'}", [
                self.python, "-c", "import sys; from engine.loader.resolve import resolve_model as r; "
                "print(r(sys.argv[1])[0])", source], 600)

    def start(self) -> None:
        self.builder.start()

    def metrics_urls(self) -> dict[str, str]:
        """Every child's Prometheus endpoint, for the run file (and a scrape config)."""
        return self.builder.metrics_urls(self.options.gateway_url)


def serve_cluster_spec(options: ServeOptions, infra: InfraEndpoints, restart: RestartPolicy,
                       usage_spool_dir: Path | None = None) -> ClusterSpec:
    """What `baton serve` starts: scheduler, each model's workers, safety, billing and the gateway."""
    o = options
    env: dict[str, str] = {}
    if o.models:
        env["BATON_MODEL"] = o.models[0].source
        if o.models[0].name:
            env["BATON_SERVED_MODEL_NAME"] = o.models[0].name
    if o.models[1:]:
        env["BATON_EXTRA_MODELS"] = json.dumps({s.served_name: s.source for s in o.models[1:]})
    if usage_spool_dir is not None:
        env["BATON_USAGE_SPOOL_DIR"] = str(usage_spool_dir)
    workers = tuple(w for i, model in enumerate(o.models or (None,)) for w in _model_workers(o, model, i == 0))
    return ClusterSpec(
        workers=workers, infra=infra, scheduler=SchedulerSpec() if o.scheduler else None,
        safety=SafetySpec() if o.safety else None, billing=BillingSpec(),
        gateway=GatewaySpec(host=o.host, port=o.port, grpc_port=o.grpc_port, processes=o.gateway_processes, env=env),
        restart=restart)


def _model_workers(options: ServeOptions, model: ModelSpec | None, first: bool) -> tuple[WorkerPlan, ...]:
    """One model's workers: prefill + decode, or one `both`."""
    layout = Layout(0, 1) if options.workers_role == "both" else Layout(1, 1)
    prefix = "worker-" if first or model is None else f"worker-{model.served_name}-"
    args = ["--torch-threads", str(options.worker_threads)]
    if model is not None:
        args += ["--model", model.source, "--model-id", model.served_name]
    if options.num_blocks:
        args += ["--num-blocks", str(options.num_blocks)]
    args += parallel_worker_args(options)
    args += quantization_worker_args(options.quantization, options.kv_cache_dtype)
    fleet = WorkerFleet(layout, RoleArgs(common=tuple(args)), name_prefix=prefix,
                        model="" if model is None else model.served_name)
    return tuple(replace(p, args=p.args + tuple(kv_tier_worker_args(options, p.name))) for p in fleet.plans())
