"""The scheduler process: gRPC server (Scheduler + health), tick loop and /metrics, started and
drained as one unit.

Drain order on `stop` (SIGTERM): health turns NOT_SERVING first so balancers stop sending, queued
Route calls are answered UNAVAILABLE at once (their gateways fall back to their last view instead
of waiting out the grace), then in-flight calls get `drain_grace_s` to finish, and only then does
the tick loop stop: a tick must not run against a server that can no longer answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler.adapters.clock import Clock, MonotonicClock
from scheduler.adapters.loop_watch import GcPauses, watch_loop
from scheduler.adapters.metrics import SchedulerMetrics
from scheduler.adapters.profiles import ProfileBook
from scheduler.adapters.servicer import SchedulerServicer, ServicerConfig
from scheduler.core.policies import POLICY_NAMES, GoodputConfig, GoodputPolicy, Policy, make_policy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.native import compiled
from scheduler.types import Tier
from services.common.cluster_auth import ClusterToken, bind_internal_port, internal_server

log = logging.getLogger(__name__)

SERVICE_NAME = "baton.v1.Scheduler"  # the health-check service name, as in the proto package
DEFAULT_PORT = 50070


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT  # 0: any free port (tests); `SchedulerService.port` tells which
    policy: str = "goodput"
    profile_path: str | None = None  # see profiles.py for the file's two forms
    metrics_port: int | None = None  # None: no /metrics server; 0: any free port
    # Silence after which a worker is dead and never routed to. Workers heartbeat from a thread of their
    # own, whatever their steps take (services/worker/heartbeat.py), so this bounds a stalled process,
    # not a long step; 10 s, not 3, because each false death resets the worker's cost model and prefix
    # index (docs/operations.md, "Heartbeats and liveness").
    heartbeat_timeout_s: float = 10.0
    drain_grace_s: float = 5.0
    # Goodput policy under overload: serve these tiers with max_tokens x this fraction before
    # queueing them (None: never degrade).
    degrade_fraction: float | None = None
    degrade_tiers: frozenset[Tier] = frozenset({Tier.FREE})
    degrade_models: Mapping[str, str] = field(default_factory=dict)  # model -> smaller fallback model
    servicer: ServicerConfig = field(default_factory=ServicerConfig)
    # Calls without it are refused UNAUTHENTICATED (services/common/cluster_auth.py); None: open.
    cluster_token: ClusterToken | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; valid: {', '.join(POLICY_NAMES)}")
        if self.heartbeat_timeout_s <= 2 * self.servicer.heartbeat_interval_s:
            # One late heartbeat must not kill a worker: its requests would all be rerouted.
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice the heartbeat "
                f"interval ({self.servicer.heartbeat_interval_s})"
            )
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        degrading = self.degrade_fraction is not None or self.degrade_models
        if degrading and self.policy != GoodputPolicy.name:
            raise ValueError(f"degrading (fraction or models) needs the goodput policy, not {self.policy!r}")
        GoodputConfig(degrade_fraction=self.degrade_fraction, degrade_models=self.degrade_models)  # validates

    def make_policy(self) -> Policy:
        if self.policy == GoodputPolicy.name:
            config = GoodputConfig(degrade_fraction=self.degrade_fraction, degrade_tiers=self.degrade_tiers,
                                   degrade_models=self.degrade_models)
            return GoodputPolicy(config)
        return make_policy(self.policy)


class SchedulerService:
    """Owns one core `Scheduler`; create, `await start()`, then `await stop()` (or `serve()`)."""

    def __init__(
        self,
        config: SchedulerServiceConfig | None = None,
        clock: Clock | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.config = config or SchedulerServiceConfig()
        profiles = ProfileBook.load(self.config.profile_path) if self.config.profile_path else ProfileBook()
        self.scheduler = scheduler or Scheduler(
            self.config.make_policy(), SchedulerConfig(heartbeat_timeout_s=self.config.heartbeat_timeout_s)
        )
        self.metrics = SchedulerMetrics()
        self.servicer = SchedulerServicer(
            self.scheduler, clock or MonotonicClock(), self.metrics, profiles, self.config.servicer
        )
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._ticks: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._gc_pauses: GcPauses | None = None
        self._metrics_server: WSGIServer | None = None
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> None:
        server = internal_server(self.config.cluster_token, "scheduler")
        pb_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{self.config.host}:{self.config.port}"
        self.port = bind_internal_port(server, address)
        await server.start()
        self._server = server
        self._ticks = asyncio.create_task(self.servicer.run_ticks(), name="scheduler-ticks")
        self._gc_pauses = GcPauses("scheduler", self.metrics.gc_pause)
        self._watch = asyncio.create_task(
            watch_loop("scheduler", self.metrics.loop_lag, cpu=self.metrics.loop_cpu, gc_pauses=self._gc_pauses),
            name="scheduler-loop-watch",
        )
        if self.config.metrics_port is not None:
            self._metrics_server = self.metrics.serve(self.config.metrics_port, self.config.host)
            self.metrics_port = self._metrics_server.server_port
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "scheduler (%s, %s decision path) listening on %s:%d, metrics on %s",
            self.config.policy, "compiled" if compiled() else "interpreted", self.config.host, self.port,
            self.metrics_port,
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain and stop (see the module docstring); safe to call twice."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await self._health.enter_graceful_shutdown()
        self.servicer.end_waits("scheduler shutting down")
        await server.stop(self.config.drain_grace_s if grace_s is None else grace_s)
        tasks = [t for t in (self._ticks, self._watch) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._gc_pauses is not None:
            self._gc_pauses.stop()
            self._gc_pauses = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        log.info("scheduler stopped")

    async def serve(self, stop: asyncio.Event) -> None:
        """Start, run until `stop` is set (SIGTERM/SIGINT in main), then drain."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
