"""Prometheus metrics of the scheduler service (`baton_scheduler_*`).

Each `SchedulerMetrics` owns its registry rather than using the process-global one, so several
services can live in one test process and a scrape shows exactly one scheduler. Everything is
written from the service's event loop; prometheus_client's own locks make the scrape thread safe.
"""

from __future__ import annotations

from collections import Counter as Tally
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler.types import RouteDecision, WorkerRole, WorkerSnapshot

# Predictions span a cached short prompt (ms) to a long prompt behind a queue (tens of seconds).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "baton_scheduler_decisions", "Routing decisions by kind and reason (queue included).",
            ["kind", "reason"], registry=r,
        )
        self.live_workers = Gauge("baton_scheduler_live_workers", "Live workers by role.", ["role"], registry=r)
        self.queue_depth = Gauge("baton_scheduler_queue_depth", "Requests in the admission queue.", registry=r)
        self.predicted_ttft = Histogram(
            "baton_scheduler_predicted_ttft_seconds", "Predicted TTFT of placed requests.",
            buckets=_TTFT_BUCKETS_S, registry=r,
        )
        self.predicted_tpot = Histogram(
            "baton_scheduler_predicted_tpot_seconds", "Predicted TPOT of placed requests.",
            buckets=_TPOT_BUCKETS_S, registry=r,
        )
        self.queue_wait = Histogram(
            "baton_scheduler_queue_wait_seconds", "Time queued requests waited for their answer.",
            buckets=_WAIT_BUCKETS_S, registry=r,
        )
        self.heartbeats = Counter(
            "baton_scheduler_heartbeats", "Heartbeats by outcome (applied, unknown, invalid).", ["outcome"],
            registry=r,
        )
        self.registrations = Counter("baton_scheduler_registrations", "Worker registrations.", registry=r)
        self.workers_expired = Counter(
            "baton_scheduler_workers_expired", "Workers dropped after missing their heartbeat deadline.",
            registry=r,
        )

    def observe_decision(self, decision: RouteDecision) -> None:
        self.decisions.labels(decision.kind.value, decision.reason).inc()
        if decision.is_placed:
            if decision.predicted_ttft_ms is not None:
                self.predicted_ttft.observe(decision.predicted_ttft_ms / 1e3)
            if decision.predicted_tpot_ms is not None:
                self.predicted_tpot.observe(decision.predicted_tpot_ms / 1e3)

    def set_workers(self, snapshots: list[WorkerSnapshot]) -> None:
        by_role = Tally(s.role for s in snapshots)
        for role in WorkerRole:  # every role, so a role that lost its last worker reads 0
            self.live_workers.labels(role.value).set(by_role[role])

    def serve(self, port: int, host: str = "0.0.0.0") -> WSGIServer:
        """Expose /metrics on `port` (0: any free port) from a daemon thread; `.shutdown()` stops it
        and `.server_port` is the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
