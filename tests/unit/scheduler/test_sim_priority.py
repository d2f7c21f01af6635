"""A simulated worker admits waiting sequences in the engine batcher's order: by the tier's priority,
first come first served within one (engine/batcher.py; tests/unit/engine/test_batcher.py)."""

from __future__ import annotations

import random

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.sequence import SimSequence
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole


def _seq(rid: str, tier: Tier, label: int) -> SimSequence:
    arrival = Arrival(0.0, rid, 64, 8, extend_chain((), 4, label=label), tier)
    return SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="w", prefill_worker=None)


def test_waiting_sequences_get_a_free_slot_by_tier_then_in_arrival_order() -> None:
    worker = SimWorker(SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile(), max_batch=1), random.Random(0), 0.0)
    order = [("free1", Tier.FREE), ("ent1", Tier.ENTERPRISE), ("plus", Tier.PLUS), ("ent2", Tier.ENTERPRISE),
             ("free2", Tier.FREE)]
    seqs = {rid: _seq(rid, tier, i) for i, (rid, tier) in enumerate(order)}
    for seq in seqs.values():
        worker.admit(seq)
    admitted = []
    for _ in order:
        (ready,) = worker.allocate_waiting()
        admitted.append(ready.arrival.request_id)
        worker._release(ready, 0.0)  # its slot frees: the next one is admitted
    assert admitted == ["ent1", "ent2", "plus", "free1", "free2"]


def test_a_queued_prompt_is_prefilled_by_tier_but_one_part_way_through_its_chunks_keeps_its_place() -> None:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile(), max_prefill_tokens=64, max_prefill_chunk=32)
    worker = SimWorker(spec, random.Random(0), 0.0)
    started = _seq("started", Tier.FREE, 0)
    worker.enqueue_prefill(started)
    worker._prefill_queue[0].done_tokens = 32  # its first chunk ran
    for i, (rid, tier) in enumerate([("free", Tier.FREE), ("ent", Tier.ENTERPRISE)], start=1):
        worker.enqueue_prefill(_seq(rid, tier, i))
    assert [job.seq.arrival.request_id for job in worker._prefill_queue] == ["started", "ent", "free"]
