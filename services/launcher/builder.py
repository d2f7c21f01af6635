"""The cluster builder: a `ClusterSpec` becomes supervised processes and typed endpoints.

One place starts Baton's processes, for `baton serve` (cluster.py), the lab's experiments and GPU
benchmarks, and the integration tests: the scheduler, the workers (`WorkerPlan`s, usually a
`WorkerFleet` of the planner's `Layout`, fleet.py), safety, the billing consumer and the gateway,
each a `ChildSpec` started by the `Supervisor`, in that order, each after the previous is ready.
What callers differ in is in the spec: which services run, flags and environment per role, whether
Postgres/Redis/the broker are there (`infra`; who starts them is the caller's: embedded or external),
and ports.

Ports: every child's ports are picked here (free ones, picked again when the child lost one before
binding it: `retry_lost_port_race`), except the gateway's when the spec names them. `served` says
what each child serves on which port (the run file's `endpoints`, rundir.py), `ports` the same flat
("<child>", "<child>-metrics", "gateway-grpc"), as fault injection reads it.

Workers start one by one (`baton serve`: a lost port race is retried per worker), or all at once and
then waited for (`start_workers_together`: GPU workers spend minutes loading weights and capturing
CUDA graphs, and that should overlap). The cluster token, when given, reaches every child in its
environment (never on a command line, where any local user's `ps` would see it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.types import WorkerRole
from services.common.cluster_auth import TOKEN_ENV, ClusterToken
from services.common.errors import ConfigError
from services.launcher.fleet import WorkerPlan
from services.launcher.infra import InfraEndpoints
from services.launcher.process import free_port, retry_lost_port_race, start_on_free_port
from services.launcher.rundir import Endpoint
from services.launcher.supervisor import ChildSpec, ReadyCheck, RestartPolicy, Supervisor, http_ok, listening, log_line

WORKER_READY = "BATON_WORKER_READY"
BILLING_READY = "billing consumer:"
# A billing consumer killed without leaving its group holds its partitions until the broker gives up on
# it: librdkafka's defaults (45 s session, 300 s rebalance) would stall billing for minutes after a crash.
FAST_GROUP_RECOVERY = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 30000}
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class SchedulerSpec:
    name: str = "scheduler"  # the child's (a test may run a second one beside a stack's)
    module: str = "scheduler.adapters"  # or a wrapper with the same flags (the lab's scheduler tap)
    args: tuple[str, ...] = ()  # after --host/--port/--metrics-port: policy, heartbeats, profile, ...
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0


@dataclass(frozen=True)
class SafetySpec:
    name: str = "safety"  # the child's (several may run under one supervisor: tests with their own policies)
    args: tuple[str, ...] = ()  # e.g. --policy <file>
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0


@dataclass(frozen=True)
class BillingSpec:
    env: Mapping[str, str] = field(default_factory=dict)  # beside the infra's; e.g. its topic and group
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 20.0


@dataclass(frozen=True)
class GatewaySpec:
    name: str = "gateway"  # the child's (tests run several gateways on one stack)
    host: str = LOCALHOST
    port: int | None = None  # None: a free port, picked as the gateway starts (again on a lost race)
    grpc_port: int | None = None  # its internal gRPC API; None: off
    processes: int | None = None  # gateway processes on its port (replicas.py); None: BATON_GATEWAY_PROCESSES or 1
    # Last, over what the builder sets (infra, BATON_WORKER_ADDRESSES, scheduler and safety addresses).
    env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    stop_timeout_s: float = 40.0


@dataclass(frozen=True)
class ClusterSpec:
    workers: tuple[WorkerPlan, ...] = ()
    infra: InfraEndpoints | None = None  # Postgres, Redis, the broker for billing and the gateway
    scheduler: SchedulerSpec | None = SchedulerSpec()  # None: the gateway routes statically
    safety: SafetySpec | None = None
    billing: BillingSpec | None = None
    gateway: GatewaySpec | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # every child's
    worker_ready_timeout_s: float = 300.0
    worker_stop_timeout_s: float = 20.0
    start_workers_together: bool = False
    restart: RestartPolicy | None = None  # every child's; None: a death ends `Supervisor.watch()`

    def __post_init__(self) -> None:
        """Worker names are unique, and a decode worker's peers are prefill workers planned before it
        (their addresses are on its command line)."""
        seen: dict[str, WorkerRole] = {}
        for plan in self.workers:
            if plan.name in seen:
                raise ConfigError(f"two workers are named {plan.name!r}: each needs its own name (and log)")
            unknown = [p for p in plan.prefill_peers if seen.get(p) is not WorkerRole.PREFILL]
            if unknown:
                raise ConfigError(f"worker {plan.name!r}: prefill peers {unknown} are not prefill workers planned "
                                  f"before it (planned: {sorted(seen)})")
            seen[plan.name] = plan.role


@dataclass(frozen=True)
class WorkerEndpoint:
    name: str
    role: WorkerRole
    address: str  # host:port of its gRPC API
    metrics_url: str
    model: str = ""


@dataclass(frozen=True)
class ClusterEndpoints:
    workers: tuple[WorkerEndpoint, ...] = ()
    scheduler: str | None = None  # host:port
    scheduler_metrics_url: str | None = None
    safety: str | None = None
    gateway_url: str | None = None  # http://host:port, no trailing slash
    gateway_grpc: str | None = None

    def worker(self, name: str) -> WorkerEndpoint:
        return next(w for w in self.workers if w.name == name)


class ClusterBuilder:
    """Starts one `ClusterSpec` under `supervisor` (which stops it: `stop_all()`); not thread-safe."""

    def __init__(self, spec: ClusterSpec, supervisor: Supervisor, cluster_token: ClusterToken | None = None,
                 python: str = sys.executable) -> None:
        """`cluster_token`: what every internal port asks for (None: children run without one, open)."""
        self.spec = spec
        self.supervisor = supervisor
        self.cluster_token = cluster_token
        self.python = python
        self.ports: dict[str, int] = {}  # "<child>", "<child>-metrics" and "gateway-grpc" -> port
        self.served: dict[str, dict[Endpoint, int]] = {}  # child -> what it serves on which port

    def start(self) -> ClusterEndpoints:
        s = self.spec
        scheduler = self._start_scheduler(s.scheduler) if s.scheduler else None
        workers = self._start_workers(scheduler)
        safety = self._start_safety(s.safety) if s.safety else None
        if s.billing is not None:
            self._start_billing(s.billing)
        gateway = self._start_gateway(s.gateway, scheduler, safety, workers) if s.gateway else None
        return ClusterEndpoints(
            workers, scheduler, self.metrics_url(s.scheduler.name) if s.scheduler else None, safety,
            gateway, None if s.gateway is None or s.gateway.grpc_port is None else f"{LOCALHOST}:{s.gateway.grpc_port}")

    def metrics_url(self, child: str) -> str:
        return f"http://{LOCALHOST}:{self.served[child][Endpoint.METRICS]}/metrics"

    def metrics_urls(self, gateway_url: str | None = None) -> dict[str, str]:
        """Every child's Prometheus endpoint (the gateway's is on its HTTP port: `gateway_url`)."""
        urls = {child: self.metrics_url(child) for child, ports in self.served.items() if Endpoint.METRICS in ports}
        gateway = self.spec.gateway
        if gateway is not None and gateway.name in self.served and gateway_url is not None:
            urls[gateway.name] = f"{gateway_url}/metrics"
        return urls

    def _port(self, child: str, endpoint: Endpoint, port: int | None = None) -> int:
        """Record (and pick, unless given) the port `child` serves `endpoint` on."""
        port = free_port() if port is None else port
        self.served.setdefault(child, {})[endpoint] = port
        is_gateway = self.spec.gateway is not None and child == self.spec.gateway.name
        suffix = {Endpoint.METRICS: "-metrics", Endpoint.GRPC: "-grpc" if is_gateway else ""}
        self.ports[child + suffix.get(endpoint, "")] = port
        return port

    def _child(self, name: str, argv: list[str], ready: ReadyCheck, env: Mapping[str, str],
               ready_timeout_s: float, stop_timeout_s: float) -> ChildSpec:
        token = {TOKEN_ENV: self.cluster_token.value} if self.cluster_token is not None else {}
        return ChildSpec(name, argv, ready, env={**token, **self.spec.env, **env}, ready_timeout_s=ready_timeout_s,
                         stop_timeout_s=stop_timeout_s, restart=self.spec.restart)

    def _start_scheduler(self, spec: SchedulerSpec) -> str:
        return retry_lost_port_race(lambda: self._try_scheduler(spec))

    def _try_scheduler(self, spec: SchedulerSpec) -> str:
        port, metrics = self._port(spec.name, Endpoint.GRPC), self._port(spec.name, Endpoint.METRICS)
        argv = [self.python, "-m", spec.module, "--host", LOCALHOST, "--port", str(port),
                "--metrics-port", str(metrics), *spec.args]
        self.supervisor.start(self._child(spec.name, argv, listening(port), {}, spec.ready_timeout_s,
                                          spec.stop_timeout_s))
        return f"{LOCALHOST}:{port}"

    def _start_workers(self, scheduler: str | None) -> tuple[WorkerEndpoint, ...]:
        started: dict[str, WorkerEndpoint] = {}
        together: list[ChildSpec] = []
        for plan in self.spec.workers:
            peers = [started[name].address for name in plan.prefill_peers]
            if self.spec.start_workers_together:
                spec, started[plan.name] = self._worker(plan, scheduler, peers)
                together.append(spec)
            else:
                started[plan.name] = self._start_worker(plan, scheduler, peers)
        if together:
            self.supervisor.start_together(together)
        return tuple(started.values())

    def _start_worker(self, plan: WorkerPlan, scheduler: str | None, peers: list[str]) -> WorkerEndpoint:
        def attempt() -> WorkerEndpoint:
            spec, endpoint = self._worker(plan, scheduler, peers)
            self.supervisor.start(spec)
            return endpoint
        return retry_lost_port_race(attempt)

    def _worker(self, plan: WorkerPlan, scheduler: str | None, peers: list[str]) -> tuple[ChildSpec, WorkerEndpoint]:
        port, metrics = self._port(plan.name, Endpoint.GRPC), self._port(plan.name, Endpoint.METRICS)
        argv = worker_argv(plan, port, metrics, python=self.python, prefill_peers=peers, scheduler=scheduler)
        spec = self._child(plan.name, argv, log_line(WORKER_READY), plan.env, self.spec.worker_ready_timeout_s,
                           self.spec.worker_stop_timeout_s)
        return spec, WorkerEndpoint(plan.name, plan.role, f"{LOCALHOST}:{port}", self.metrics_url(plan.name),
                                    plan.model)

    def _start_safety(self, spec: SafetySpec) -> str:
        return retry_lost_port_race(lambda: self._try_safety(spec))

    def _try_safety(self, spec: SafetySpec) -> str:
        port, metrics = self._port(spec.name, Endpoint.GRPC), self._port(spec.name, Endpoint.METRICS)
        argv = [self.python, "-m", "services.safety", "--host", LOCALHOST, "--port", str(port),
                "--metrics-port", str(metrics), *spec.args]
        self.supervisor.start(self._child(spec.name, argv, listening(port), spec.env, spec.ready_timeout_s,
                                          spec.stop_timeout_s))
        return f"{LOCALHOST}:{port}"

    def _start_billing(self, spec: BillingSpec) -> None:
        retry_lost_port_race(lambda: self._try_billing(spec))

    def _try_billing(self, spec: BillingSpec) -> None:
        env = {**self._infra_env(), "BATON_BILLING_METRICS_PORT": str(self._port("billing", Endpoint.METRICS)),
               **spec.env}
        if "BATON_KAFKA_CONSUMER_CONFIG" not in {**os.environ, **env}:
            env["BATON_KAFKA_CONSUMER_CONFIG"] = json.dumps(FAST_GROUP_RECOVERY)
        self.supervisor.start(self._child("billing", [self.python, "-m", "services.billing"], log_line(BILLING_READY),
                                          env, spec.ready_timeout_s, spec.stop_timeout_s))

    def _infra_env(self) -> dict[str, str]:
        return self.spec.infra.env() if self.spec.infra is not None else {}

    def _start_gateway(self, spec: GatewaySpec, scheduler: str | None, safety: str | None,
                       workers: tuple[WorkerEndpoint, ...]) -> str:
        """The gateway's URL; its static routes are the default (first) model's decode-capable workers."""
        default_model = workers[0].model if workers else ""
        routes = [w.address for w in workers if w.role.can_decode and w.model == default_model]
        env = {**self._infra_env(), "BATON_WORKER_ADDRESSES": json.dumps(routes),
               **({"BATON_SCHEDULER_ADDRESS": scheduler} if scheduler else {}),
               **({"BATON_SAFETY_ADDRESS": safety} if safety else {}), **spec.env}
        reachable = "127.0.0.1" if spec.host in ("0.0.0.0", "") else spec.host

        def start(port: int) -> str:
            self._port(spec.name, Endpoint.HTTP, port)
            url = f"http://{reachable}:{port}"
            argv = [self.python, "-m", "services.gateway", "--host", spec.host, "--port", str(port)]
            if spec.processes is not None:
                argv += ["--processes", str(spec.processes)]
            if spec.grpc_port is not None:
                argv += ["--grpc-port", str(self._port(spec.name, Endpoint.GRPC, spec.grpc_port))]
            self.supervisor.start(self._child(spec.name, argv, http_ok(f"{url}/readyz"), env, spec.ready_timeout_s,
                                              spec.stop_timeout_s))
            return url

        return start(spec.port) if spec.port is not None else start_on_free_port(start)


def worker_argv(plan: WorkerPlan, port: int, metrics_port: int, *, python: str = sys.executable,
                prefill_peers: Sequence[str] = (), scheduler: str | None = None) -> list[str]:
    """The command line of `plan`'s worker serving gRPC on `port` and /metrics on `metrics_port` (LOCALHOST);
    `prefill_peers` are host:port addresses. What starts a worker process (this builder, the integration
    tests' `WorkerProcess`) builds it here."""
    return [python, "-m", "services.worker", "--role", str(plan.role), "--host", LOCALHOST,
            "--port", str(port), "--metrics-port", str(metrics_port),
            *(["--worker-id", plan.name] if plan.worker_id else []), *plan.args,
            *(["--prefill-peers", ",".join(prefill_peers)] if prefill_peers else []),
            *(["--scheduler", scheduler] if scheduler else [])]


def start_cluster(spec: ClusterSpec, supervisor: Supervisor,
                  cluster_token: ClusterToken | None = None) -> ClusterEndpoints:
    """Start `spec` under `supervisor` (its own: on any failure every child of it is stopped) and raise."""
    try:
        return ClusterBuilder(spec, supervisor, cluster_token).start()
    except BaseException:
        supervisor.stop_all()
        raise

