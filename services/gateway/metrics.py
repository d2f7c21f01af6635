"""Prometheus metrics of the gateway (`baton_gateway_*`), in a registry of its own per app.

A registry per app (not the process-global one) lets tests build several apps in one process and
keeps `/metrics` to what this gateway measures. With several gateway processes on one port
(replicas.py) a scrape reaches any one of them, so they keep their values in prometheus_client's
multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set by the supervisor before the replica imports
prometheus_client) and each renders the sum of all of them, plus its own extra collectors.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from scheduler.adapters.loop_watch import LAG_BUCKETS_S
from services.gateway.replicas import METRICS_DIR_ENV
from services.safety.limits import LATENCY_BUCKETS_S, size_bucket
from tokenization.finish_reason import FinishReason

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_gateway_requests", "HTTP requests by route and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("baton_gateway_request_seconds",
                                         "HTTP handling time to the response head", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("baton_gateway_ttft_seconds", "Time to first token of a generation",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_gateway_e2e_seconds", "Request arrival to the last token",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("baton_gateway_tokens", "Tokens by kind (prompt, cached, completion)",
                              ["model", "kind"], registry=r)
        self.finished = Counter("baton_gateway_generations_finished", "Generations by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.inflight = Gauge("baton_gateway_inflight_generations", "Generations running now", registry=r,
                              multiprocess_mode="livesum")
        self.refusals = Counter("baton_gateway_refusals", "Requests refused before generating, by reason",
                                ["reason"], registry=r)
        self.safety_check = Histogram("baton_gateway_safety_check_seconds", "Time a request waited for its input "
                                      "safety check, by the size of the new text (le_100_words, le_1k_words, "
                                      "le_5k_words, le_max)", ["size"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.replays = Counter("baton_gateway_stream_resumes", "Last-Event-ID stream resumes", registry=r)
        self.migrations = Counter("baton_request_migrations", "Generations whose worker was lost, by what the "
                                  "gateway did: retried, migrated, limit_exceeded, no_worker", ["outcome"], registry=r)
        self.loop_lag = Histogram("baton_gateway_event_loop_lag_seconds", "How late the event loop woke from "
                                  "a 50 ms sleep: every call it serves waited as long",
                                  buckets=LAG_BUCKETS_S, registry=r)
        self.gc_pause = Histogram("baton_gateway_gc_pause_seconds", "Garbage collection pauses",
                                  buckets=LAG_BUCKETS_S, registry=r)
        # Against the completion tokens: how many tokens a worker message carried. A worker coalesces the
        # tokens a lagging caller has not read yet (services/worker/decode_jobs.py), so under load the
        # gateway handles fewer messages per token (lab/experiments/gateway_cost.py).
        self.worker_messages = Counter("baton_gateway_worker_messages", "Generate stream messages received "
                                       "from workers", registry=r)
        self.loop_cpu = Counter("baton_gateway_event_loop_cpu_seconds", "CPU time of the event loop's thread, "
                                "which every request and streamed token queues on", registry=r)
        self._extra: list[Collector] = []

    def observe_generation(self, model: str, finish_reason: FinishReason, prompt: int, cached: int, completion: int,
                           ttft_s: float | None, e2e_s: float) -> None:
        self.tokens.labels(model, "prompt").inc(prompt)
        self.tokens.labels(model, "cached").inc(cached)
        self.tokens.labels(model, "completion").inc(completion)
        self.finished.labels(model, finish_reason).inc()
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        self.e2e.labels(model).observe(e2e_s)

    def observe_safety_check(self, seconds: float, chars: int) -> None:
        self.safety_check.labels(size_bucket(chars)).observe(seconds)

    def register_extra(self, collector: Collector) -> None:
        """A collector of this process's own state (e.g. the billing outbox's backlog)."""
        self.registry.register(collector)
        self._extra.append(collector)

    def render(self) -> bytes:
        shared_dir = os.environ.get(METRICS_DIR_ENV)
        if not shared_dir:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, shared_dir)
        for collector in self._extra:
            merged.register(collector)
        return generate_latest(merged)
