"""Prometheus metrics of one worker (`baton_` prefix), on a registry of its own.

Updated from the event loop and from the engine thread (prometheus_client is thread-safe).
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.step_stats import StepStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.035, 0.05, 0.075, 0.1,
                  0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


class HandoffPhase(StrEnum):
    """Where a disaggregated request's time goes (`baton_pd_handoff_phase_seconds{phase}`)."""

    QUEUE_WAIT = "queue_wait"  # prefill worker: Prefill RPC in -> its first chunk scheduled
    PREFILL_COMPUTE = "prefill_compute"  # prefill worker: first chunk scheduled -> first token resolved
    PREFILL_JOB = "prefill_job"  # prefill worker: Prefill RPC in -> WRITE done
    # prefill worker: first token held -> WRITE done (streamed: the last part and the notice; the
    # earlier parts went while later chunks computed)
    WRITE_AFTER_PREFILL = "write_after_prefill"
    RESERVE = "reserve"  # decode worker: blocks asked of the engine -> reserved (a step boundary away)
    NOTICE_WAIT = "notice_wait"  # decode worker: Prefill RPC sent -> DONE notice seen by the KV link
    NOTICE_TO_COMMIT = "notice_to_commit"  # decode worker: DONE notice seen -> verified and in the batch
    HANDOFF = "handoff"  # decode worker: blocks reserved -> committed (the whole remote prefill)
    # decode worker: HANDOFF minus the prefill worker's own queue wait + compute (from the notice):
    # what disaggregation adds to TTFT (RPC, WRITE, notice, verification, commit)
    OVERHEAD = "overhead"


class WorkerMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.role = role
        self.requests = Counter("baton_worker_requests", "RPCs served, by rpc and status code",
                                ["rpc", "code"], registry=r)
        self.tokens = Counter("baton_worker_tokens", "Tokens processed, by kind (prompt | generated)",
                              ["kind"], registry=r)
        self.step_seconds = Histogram("baton_engine_step_seconds", "Engine step time, by kind of step",
                                      ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.served_step_seconds = Histogram(
            "baton_engine_served_step_seconds",
            "Engine loop time per step (bookkeeping, emission and the step), by kind of step",
            ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.free_blocks = Gauge("baton_kv_free_blocks", "KV blocks an allocation may take", registry=r)
        self.total_blocks = Gauge("baton_kv_total_blocks", "KV blocks in the pool", registry=r)
        self.fallbacks = Counter("baton_pd_fallback", "Requests whose remote prefill fell back, by reason",
                                 ["reason"], registry=r)
        self.prefill_path = Counter("baton_pd_prefill_path", "Where decode requests were prefilled",
                                    ["path"], registry=r)
        self.transfer_seconds = Histogram("baton_kv_transfer_seconds", "KV WRITE time (posted -> terminal)",
                                          ["outcome"], buckets=_TRANSFER_BUCKETS, registry=r)
        self.transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes written to decode workers",
                                      registry=r)
        self.handoff_seconds = Histogram("baton_pd_handoff_seconds",
                                         "Decode side: reserve -> KV landed and committed (remote prefills)",
                                         buckets=_STEP_BUCKETS, registry=r)
        self.quarantined = Gauge("baton_kv_quarantined_requests",
                                 "Requests whose blocks wait for a late WRITE's notice", registry=r)
        self.held_blocks = Gauge("baton_kv_held_blocks", "Prefill: blocks held for pending WRITEs", registry=r)
        self.stream_parts = Counter("baton_kv_stream_parts",
                                    "Prefill: KV parts written while the prompt's later chunks computed", registry=r)
        self.handoff_phases = Histogram("baton_pd_handoff_phase_seconds",
                                        "KV hand-off phases (successful remote prefills), by phase",
                                        ["phase"], buckets=_PHASE_BUCKETS, registry=r)

        # Speculative decoding (n-gram drafts): acceptance = accepted / draft tokens, tokens per verify =
        # (accepted + verify chunks) / verify chunks.
        self.spec_verify_chunks = Counter("baton_spec_verify_chunks", "Decodes that verified a draft",
                                          registry=r)
        self.spec_draft_tokens = Counter("baton_spec_draft_tokens", "Draft tokens proposed and verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("baton_spec_accepted_tokens", "Draft tokens the model kept",
                                            registry=r)

    def handoff_phase(self, phase: HandoffPhase, seconds: float) -> None:
        self.handoff_phases.labels(phase.value).observe(seconds)

    def observe_step(self, stats: StepStats) -> None:
        """Engine thread: one step's time, labelled prefill / decode / mixed."""
        if stats.prefill_tokens and stats.decode_seqs:
            kind = "mixed"
        elif stats.prefill_tokens:
            kind = "prefill"
        else:
            kind = "decode"
        self.step_seconds.labels(kind).observe(stats.seconds)
        if stats.served_seconds is not None:
            self.served_step_seconds.labels(kind).observe(stats.served_seconds)
        if stats.prefill_tokens:
            self.tokens.labels("prompt").inc(stats.prefill_tokens)
        spec = stats.speculation
        if spec.verify_chunks:
            self.spec_verify_chunks.inc(spec.verify_chunks)
            self.spec_draft_tokens.inc(spec.draft_tokens)
            self.spec_accepted_tokens.inc(spec.accepted_tokens)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
