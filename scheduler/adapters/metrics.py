"""Prometheus metrics of the scheduler service (`baton_scheduler_*`).

Each `SchedulerMetrics` owns its registry rather than using the process-global one, so several
services can live in one test process and a scrape shows exactly one scheduler. Everything is
written from the service's event loop; prometheus_client's own locks make the scrape thread safe.
"""

from __future__ import annotations

from collections import Counter as Tally
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from scheduler.adapters.loop_watch import LAG_BUCKETS_S
from scheduler.core.fleet_signals import FleetSignal
from scheduler.types import RouteDecision, WorkerRole, WorkerSnapshot

# Predictions span a cached short prompt (ms) to a long prompt behind a queue (tens of seconds).
_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
_WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
_SLACK_EWMA = 0.1  # weight of the newest placement: about the last ten placements per fleet


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
        self.loop_lag = Histogram(
            "baton_scheduler_event_loop_lag_seconds",
            "How late the event loop woke from a 50 ms sleep: every Route and heartbeat waited as long.",
            buckets=LAG_BUCKETS_S, registry=r,
        )
        self.gc_pause = Histogram(
            "baton_scheduler_gc_pause_seconds", "Garbage collection pauses.", buckets=LAG_BUCKETS_S, registry=r,
        )
        self.loop_cpu = Counter(
            "baton_scheduler_event_loop_cpu_seconds",
            "CPU time of the event loop's thread, which every Route and heartbeat queues on.", registry=r,
        )
        self.role_switches = Counter(
            "baton_scheduler_role_switches", "Role switches requested (SetRole), by target role.", ["to_role"],
            registry=r,
        )
        self.switching_workers = Gauge(
            "baton_scheduler_switching_workers", "Workers draining or switching role (not routable).", registry=r,
        )
        # Autoscaling signals, one series per fleet (= worker role); see docs/operations.md.
        self.fleet_queue = Gauge(
            "baton_scheduler_fleet_queue_seconds",
            "Mean predicted wait before a new prompt starts prefilling on the fleet's workers.", ["fleet"], registry=r,
        )
        self.fleet_ttft_slack = Gauge(
            "baton_scheduler_fleet_ttft_slack_ratio",
            "Predicted TTFT slack (1 - predicted/target; < 0: late) of recent placements whose prefill "
            "ran on the fleet, exponentially averaged.", ["fleet"], registry=r,
        )
        self.fleet_kv_usage = Gauge(
            "baton_scheduler_fleet_kv_usage_ratio", "Fraction of the fleet's KV blocks used or reserved.", ["fleet"],
            registry=r,
        )
        self.fleet_prefill_backlog = Gauge(
            "baton_scheduler_fleet_prefill_backlog_tokens", "Prompt tokens queued or prefilling on the fleet.",
            ["fleet"], registry=r,
        )
        self.fleet_decode_seqs = Gauge(
            "baton_scheduler_fleet_decode_sequences", "Sequences in (or waiting for) the fleet's decode batches.",
            ["fleet"], registry=r,
        )
        self.prefill_sites = Counter(
            "baton_scheduler_prefill_sites", "Placed requests by prefill site (local, remote) and reason.",
            ["site", "reason"], registry=r,
        )
        self.failure_reports = Counter(
            "baton_scheduler_worker_failure_reports",
            "Worker failures reported by gateways, by reason and outcome (marked: made unroutable; unknown: no "
            "live worker at that address).", ["reason", "outcome"], registry=r,
        )
        self.failures_cleared = Counter(
            "baton_scheduler_worker_failures_cleared",
            "Workers reported failed that heartbeated again (routable again).", registry=r,
        )
        self._slack: dict[str, float] = {}
        self.workers_expired = Counter(
            "baton_scheduler_workers_expired", "Workers dropped after missing their heartbeat deadline.",
            registry=r,
        )

    def observe_decision(self, decision: RouteDecision) -> None:
        self.decisions.labels(decision.kind.value, decision.reason or "").inc()
        if decision.is_placed:
            if decision.predicted_ttft_ms is not None:
                self.predicted_ttft.observe(decision.predicted_ttft_ms / 1e3)
            if decision.predicted_tpot_ms is not None:
                self.predicted_tpot.observe(decision.predicted_tpot_ms / 1e3)

    def observe_slack(self, decision: RouteDecision, ttft_target_ms: float, fleet: str) -> None:
        """A placed decision's predicted TTFT slack, folded into its fleet's moving average."""
        site = "local" if decision.prefill_worker_id is None else "remote"
        self.prefill_sites.labels(site, decision.prefill_reason or "fixed_rule").inc()
        if decision.predicted_ttft_ms is None:
            return
        slack = 1.0 - decision.predicted_ttft_ms / ttft_target_ms
        previous = self._slack.get(fleet)
        self._slack[fleet] = slack if previous is None else previous + _SLACK_EWMA * (slack - previous)
        self.fleet_ttft_slack.labels(fleet).set(self._slack[fleet])

    def set_fleets(self, signals: list[FleetSignal], switching: int) -> None:
        for signal in signals:
            fleet = signal.role.value
            self.fleet_queue.labels(fleet).set(signal.queue_s)
            self.fleet_kv_usage.labels(fleet).set(signal.kv_usage)
            self.fleet_prefill_backlog.labels(fleet).set(signal.prefill_backlog_tokens)
            self.fleet_decode_seqs.labels(fleet).set(signal.decode_seqs)
        self.switching_workers.set(switching)

    def set_workers(self, snapshots: list[WorkerSnapshot]) -> None:
        by_role = Tally(s.role for s in snapshots)
        for role in WorkerRole:  # every role, so a role that lost its last worker reads 0
            self.live_workers.labels(role.value).set(by_role[role])

    def serve(self, port: int, host: str = "0.0.0.0") -> WSGIServer:
        """Expose /metrics on `port` (0: any free port) from a daemon thread; `.shutdown()` stops it
        and `.server_port` is the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
