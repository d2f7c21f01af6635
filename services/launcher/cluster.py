"""`LocalCluster`: the child processes of one `baton serve`, as supervisor specs.

Every child gets a `RestartPolicy`: when it dies, the supervisor restarts it with the same command
line, so it comes back on the same ports and the others find it again (the gateway's static decode
address and the decode worker's prefill peer stay valid; workers re-register with a restarted
scheduler). While the prefill worker is down the decode worker prefills locally (its
`prefill_unavailable` fallback), so the cluster keeps serving.

Ports: each child's ports are picked here once and kept (picked again only when the child lost one
before binding it, e.g. to another `baton serve` starting at the same time: `retry_lost_port_race`);
the gateway's requested ports are reserved (`reserve_port`) so no child is ever handed them. Every
child serves Prometheus metrics: the gateway on its HTTP port, every other child on a port of its own
(`--metrics-port`, the billing consumer's `BATON_BILLING_METRICS_PORT`). `served` says what each child
serves on which port (the run file's `endpoints`, rundir.py), `ports` the same flat ("<child>",
"<child>-metrics", "gateway-grpc"), as fault injection reads it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.cluster_auth import TOKEN_ENV, ClusterToken
from services.common.settings import Tier
from services.launcher.infra import InfraEndpoints
from services.launcher.models import ModelSpec
from services.launcher.process import free_port, retry_lost_port_race
from services.launcher.rundir import Endpoint
from services.launcher.supervisor import (
    ChildSpec,
    ReadyCheck,
    RestartPolicy,
    Supervisor,
    http_ok,
    listening,
    log_line,
)

WORKER_READY = "BATON_WORKER_READY"
BILLING_READY = "billing consumer:"
# A billing consumer killed without leaving its group holds its partitions until the broker gives up on
# it: librdkafka's defaults (45 s session, 300 s rebalance) would stall billing for minutes after a crash.
FAST_GROUP_RECOVERY = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 30000}


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
    tier: Tier = "enterprise"  # the local organisation's tier
    worker_threads: int = 1  # torch CPU threads per worker
    num_blocks: int | None = None  # KV blocks per worker (None: the engine's default)
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
        self.usage_spool_dir = usage_spool_dir
        self.endpoints = endpoints
        self.supervisor = supervisor
        self.restart = restart or RestartPolicy()
        self.python = sys.executable
        self.infra_env = endpoints.env()
        self.ports: dict[str, int] = {}  # "<child>", "<child>-metrics" and "gateway-grpc" -> port
        self.served: dict[str, dict[Endpoint, int]] = {}  # child -> what it serves on which port

    def prepare_model(self) -> None:
        """Prepare the built-in models once (in a child: the launcher itself never imports torch)."""
        builtins = [s.source for s in self.options.models if s.builtin] or ([] if self.options.models else [""])
        for source in dict.fromkeys(builtins):
            self.supervisor.run_once(f"prepare-{source or 'model'}", [
                self.python, "-c", "import sys; from engine.loader.prepare import resolve_model as r; "
                "print(r(sys.argv[1])[0])", source], 600)

    def start(self) -> None:
        scheduler = retry_lost_port_race(self._start_scheduler) if self.options.scheduler else None
        models = self.options.models or (None,)
        decode = [self._start_workers(scheduler, spec, first=i == 0) for i, spec in enumerate(models)][0]
        safety = retry_lost_port_race(self._start_safety) if self.options.safety else None
        retry_lost_port_race(self._start_billing)
        self._start_gateway(scheduler, decode, safety)

    def _port(self, child: str, endpoint: Endpoint, port: int | None = None) -> int:
        """Record (and pick, unless given) the port `child` serves `endpoint` on."""
        port = free_port() if port is None else port
        self.served.setdefault(child, {})[endpoint] = port
        suffix = {Endpoint.METRICS: "-metrics", Endpoint.GRPC: "-grpc" if child == "gateway" else ""}
        self.ports[child + suffix.get(endpoint, "")] = port
        return port

    def metrics_urls(self) -> dict[str, str]:
        """Every child's Prometheus endpoint, for the run file (and a scrape config)."""
        urls = {child: f"http://127.0.0.1:{ports[Endpoint.METRICS]}/metrics"
                for child, ports in self.served.items() if Endpoint.METRICS in ports}
        if "gateway" in self.served:
            urls["gateway"] = f"{self.options.gateway_url}/metrics"
        return urls

    def _spec(self, name: str, argv: list[str], ready: ReadyCheck, env: dict[str, str] | None = None,
              ready_timeout_s: float = 120.0, stop_timeout_s: float = 20.0) -> ChildSpec:
        # In the environment, not on the command line, where any local user's `ps` would see it.
        env = {TOKEN_ENV: self.cluster_token.value, **(env or {})}
        return ChildSpec(name, argv, ready, env=env, ready_timeout_s=ready_timeout_s,
                         stop_timeout_s=stop_timeout_s, restart=self.restart)

    def _start_scheduler(self) -> str:
        port, metrics = self._port("scheduler", Endpoint.GRPC), self._port("scheduler", Endpoint.METRICS)
        self.supervisor.start(self._spec("scheduler", [self.python, "-m", "scheduler.adapters", "--host",
                                                       "127.0.0.1", "--port", str(port), "--metrics-port",
                                                       str(metrics)], listening(port)))
        return f"127.0.0.1:{port}"

    def _worker(self, role: str, scheduler: str | None, extra: list[str], spec: ModelSpec | None = None,
                first: bool = True) -> str:
        # The default model's workers keep the plain names (run.json, fault injection); others carry theirs.
        name = f"worker-{role}" if first or spec is None else f"worker-{spec.served_name}-{role}"
        port, metrics = self._port(name, Endpoint.GRPC), self._port(name, Endpoint.METRICS)
        argv = [self.python, "-m", "services.worker", "--role", role, "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(metrics), "--torch-threads", str(self.options.worker_threads), *extra]
        if spec is not None:
            argv += ["--model", spec.source, "--model-id", spec.served_name]
        if self.options.num_blocks:
            argv += ["--num-blocks", str(self.options.num_blocks)]
        argv += kv_tier_worker_args(self.options, name)
        if scheduler:
            argv += ["--scheduler", scheduler]
        self.supervisor.start(self._spec(name, argv, log_line(WORKER_READY), ready_timeout_s=300))
        return f"127.0.0.1:{port}"

    def _start_workers(self, scheduler: str | None, spec: ModelSpec | None, first: bool) -> str:
        """One model's workers; the decode-capable worker's address."""
        if self.options.workers_role == "both":
            return retry_lost_port_race(lambda: self._worker("both", scheduler, [], spec, first))
        prefill = retry_lost_port_race(lambda: self._worker("prefill", scheduler, [], spec, first))
        peers = ["--prefill-peers", prefill]
        return retry_lost_port_race(lambda: self._worker("decode", scheduler, peers, spec, first))

    def _start_safety(self) -> str:
        port, metrics = self._port("safety", Endpoint.GRPC), self._port("safety", Endpoint.METRICS)
        self.supervisor.start(self._spec("safety", [self.python, "-m", "services.safety", "--host", "127.0.0.1",
                                                    "--port", str(port), "--metrics-port", str(metrics)],
                                         listening(port)))
        return f"127.0.0.1:{port}"

    def _start_billing(self) -> None:
        env = {**self.infra_env, "BATON_BILLING_METRICS_PORT": str(self._port("billing", Endpoint.METRICS))}
        if "BATON_KAFKA_CONSUMER_CONFIG" not in os.environ:
            env["BATON_KAFKA_CONSUMER_CONFIG"] = json.dumps(FAST_GROUP_RECOVERY)
        self.supervisor.start(self._spec("billing", [self.python, "-m", "services.billing"], log_line(BILLING_READY),
                                         env=env))

    def _start_gateway(self, scheduler: str | None, decode: str, safety: str | None) -> None:
        o = self.options
        env = {**self.infra_env, "BATON_WORKER_ADDRESSES": f'["{decode}"]'}
        if scheduler:
            env["BATON_SCHEDULER_ADDRESS"] = scheduler
        if safety:
            env["BATON_SAFETY_ADDRESS"] = safety
        if o.models:
            env["BATON_MODEL"] = o.models[0].source
            if o.models[0].name:
                env["BATON_SERVED_MODEL_NAME"] = o.models[0].name
        if o.models[1:]:
            env["BATON_EXTRA_MODELS"] = json.dumps({s.served_name: s.source for s in o.models[1:]})
        if self.usage_spool_dir is not None:
            env["BATON_USAGE_SPOOL_DIR"] = str(self.usage_spool_dir)
        self._port("gateway", Endpoint.HTTP, o.port)
        argv = [self.python, "-m", "services.gateway", "--host", o.host, "--port", str(o.port),
                "--processes", str(o.gateway_processes)]
        if o.grpc_port is not None:
            argv += ["--grpc-port", str(self._port("gateway", Endpoint.GRPC, o.grpc_port))]
        self.supervisor.start(self._spec(
            "gateway", argv,
            http_ok(f"{o.gateway_url}/readyz"), env=env, stop_timeout_s=40))
