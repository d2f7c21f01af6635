"""The scheduler tap records, per route, the load each worker had as the decision saw it."""

from __future__ import annotations

from lab.experiments.scheduler_tap import TappedScheduler
from scheduler.core.scheduler import SchedulerConfig
from scheduler.types import SLO, RequestSummary, Tier, WorkerRole, WorkerSnapshot


def _snapshot(worker_id: str, running: int, waiting: int) -> WorkerSnapshot:
    return WorkerSnapshot(worker_id, WorkerRole.BOTH, "m", f"127.0.0.1:{5000 + running}", queue_depth=waiting,
                          running_seqs=running, free_blocks=300, total_blocks=384, block_size=16,
                          inflight_prefill_tokens=40 * waiting, heartbeat_at=0.0, max_num_seqs=1,
                          inflight_prefill_requests=waiting)


def test_each_route_keeps_the_loads_it_was_decided_on() -> None:
    tap = TappedScheduler("goodput", SchedulerConfig())
    tap.register(_snapshot("busy", running=1, waiting=2), now=0.0)
    tap.register(_snapshot("idle", running=0, waiting=0), now=0.0)
    summary = RequestSummary("r1", 64, (), Tier.FREE, SLO(2500, 250), 16)
    tap.route(summary, now=0.1)
    tap.route(RequestSummary("r2", 64, (), Tier.FREE, SLO(2500, 250), 16), now=0.2)
    first, second = (route["loads"] for route in tap.routes)
    rates = {"prefill_work_rate": 0.0, "prefill_rate": 0.0, "prefill_chunk_rate": 0.0}
    assert first["busy"] | rates == {
        "running": 1, "waiting": 2, "decode_batch": 3, "max_num_seqs": 1, "queued_prefill_tokens": 80,
        "queued_prefill_requests": 2, **rates, "folded_s_per_chunk": None}
    assert first["idle"]["decode_batch"] == 0
    chosen = tap.routes[0]["decision"]["decode"]
    assert second[chosen]["decode_batch"] == first[chosen]["decode_batch"] + 1  # r1's reservation counts
