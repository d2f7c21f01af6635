"""`python -m lab.experiments.scheduler_tap --tap-out FILE [baton scheduler flags]`.

The real scheduler service (same flags, same gRPC server, same core) whose core also records what
it saw, for the simulator to replay afterwards:
- every `route` call: the request summary as the gateway sent it (prompt tokens, chained prefix
  hashes, tier, max_tokens) with its receipt time, the decision, and each worker's load as the
  decision saw it (batch, prefill backlog, slots: to tell a misprediction's inputs from its model);
- every decision a `tick` answered for a queued request;
- every step sample each worker reported, in order, with the heartbeat's receipt time;
- each worker's registration snapshot (KV blocks, block size, role);
- each worker's cost model as the scheduler had fitted it at the end.
The file is written once, after the service drained (SIGTERM). Times are `time.monotonic()`, the
clock the service hands the core; `time_offset_s` maps them to wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scheduler.adapters.main import add_scheduler_arguments, config_from_args
from scheduler.adapters.server import SchedulerService
from scheduler.core.cluster_view import WorkerLoad
from scheduler.core.cost_model import WorkerProfile
from scheduler.core.policies import Policy, make_policy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import (
    DecodeSample,
    KVEvent,
    MixedSample,
    PrefillSample,
    RequestSummary,
    RouteDecision,
    StepSample,
    WorkerSnapshot,
)


class TappedScheduler(Scheduler):
    """The core `Scheduler`, unchanged, plus a record of its inputs and answers."""

    def __init__(self, policy_name: str, config: SchedulerConfig, policy: Policy | None = None) -> None:
        """`policy`: the one to run when its configuration is more than its name (the service's flags)."""
        super().__init__(policy or make_policy(policy_name), config)
        self.policy_name = policy_name
        self.routes: list[dict[str, Any]] = []
        self.late_decisions: list[dict[str, Any]] = []
        self.samples: dict[str, list[list[Any]]] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}

    def register(self, snapshot: WorkerSnapshot, now: float, profile: WorkerProfile | None = None) -> None:
        self.snapshots[snapshot.worker_id] = {"registered_at": now, **_snapshot_json(snapshot)}
        super().register(snapshot, now, profile)

    def on_heartbeat(self, snapshot: WorkerSnapshot, samples: Iterable[StepSample],
                     kv_events: Iterable[KVEvent], now: float) -> None:
        samples = list(samples)
        rows = self.samples.setdefault(snapshot.worker_id, [])
        for s in samples:
            if isinstance(s, PrefillSample):
                rows.append(["prefill", now, s.tokens, s.attention_tokens_sq, s.seconds])
            elif isinstance(s, DecodeSample):
                rows.append(["decode", now, s.batch_size, s.context_tokens, s.seconds])
            elif isinstance(s, MixedSample):
                rows.append(["mixed", now, s.prefill_tokens, s.attention_tokens_sq, s.batch_size, s.context_tokens,
                             s.seconds])
        self.snapshots.setdefault(snapshot.worker_id, {"registered_at": now, **_snapshot_json(snapshot)})
        super().on_heartbeat(snapshot, samples, kv_events, now)

    def route(self, request: RequestSummary, now: float) -> RouteDecision:
        loads = {w.worker_id: _load_json(w) for w in self.worker_loads(now)}
        decision = super().route(request, now)
        self.routes.append({"t": now, "request": _summary_json(request), "decision": _decision_json(decision),
                            "loads": loads})
        return decision

    def tick(self, now: float) -> list[RouteDecision]:
        decisions = super().tick(now)
        self.late_decisions.extend({"t": now, "decision": _decision_json(d)} for d in decisions)
        return decisions

    def to_json(self) -> dict[str, Any]:
        fitted = {}
        for worker_id in self.snapshots:
            try:
                cost = self.cost_model(worker_id)
                fitted[worker_id] = {**asdict(cost.fitted_profile()), "mixed_decode_share": cost.mixed_decode_share}
            except KeyError:  # expired before the end
                continue
        return {"policy": self.policy_name, "time_offset_s": time.time() - time.monotonic(),
                "workers": self.snapshots, "samples": self.samples, "routes": self.routes,
                "late_decisions": self.late_decisions, "fitted_profiles": fitted}


def _snapshot_json(s: WorkerSnapshot) -> dict[str, Any]:
    return {"role": s.role.value, "model": s.model, "address": s.address, "total_blocks": s.total_blocks,
            "block_size": s.block_size}


def _load_json(w: WorkerLoad) -> dict[str, Any]:
    s = w.snapshot
    return {"running": s.running_seqs, "waiting": s.queue_depth, "decode_batch": w.decode_batch,
            "max_num_seqs": s.max_num_seqs, "queued_prefill_tokens": w.queued_prefill_tokens,
            "queued_prefill_requests": w.queued_prefill_requests,
            "prefill_work_rate": w.prefill_work_rate, "prefill_rate": w.prefill_rate,
            "prefill_chunk_rate": w.prefill_chunk_rate, "folded_s_per_chunk": w.folded_s_per_chunk}


def _summary_json(r: RequestSummary) -> dict[str, Any]:
    return {"request_id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "prefix_hashes": list(r.prefix_hashes),
            "tier": r.tier.value, "ttft_ms": r.slo.ttft_ms, "tpot_ms": r.slo.tpot_ms, "max_tokens": r.max_tokens,
            "conversation_id": r.conversation_id}


def _decision_json(d: RouteDecision) -> dict[str, Any]:
    return {"request_id": d.request_id, "kind": d.kind.value, "decode": d.decode_worker_id,
            "prefill": d.prefill_worker_id, "reason": d.reason or "", "predicted_ttft_ms": d.predicted_ttft_ms,
            "predicted_tpot_ms": d.predicted_tpot_ms, "predicted_stretch_ms": d.predicted_stretch_ms,
            "max_tokens": d.max_tokens}


async def _serve(service: SchedulerService) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await service.serve(stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.scheduler_tap", description=__doc__)
    add_scheduler_arguments(parser)
    parser.add_argument("--tap-out", type=Path, required=True, help="write the record here at exit")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    core = TappedScheduler(args.policy, SchedulerConfig(heartbeat_timeout_s=config.heartbeat_timeout_s),
                           config.make_policy())
    service = SchedulerService(config, scheduler=core)
    asyncio.run(_serve(service))
    args.tap_out.parent.mkdir(parents=True, exist_ok=True)
    args.tap_out.write_text(json.dumps(core.to_json()))
    print(f"scheduler tap: wrote {args.tap_out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
