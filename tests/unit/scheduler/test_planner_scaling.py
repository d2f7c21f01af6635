"""The planner's capacity search and the simulator's chunked prefill: what made `baton plan` overstate
capacity ~4x against the 4-GPU run (docs/benchmarks.md)."""

from __future__ import annotations

import random

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import SyntheticLengths, synthetic_trace
from scheduler.planner import scaled_trace
from scheduler.sim.sequence import SimSequence
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole


def _trace(n: int = 50) -> list[Arrival]:
    return synthetic_trace(SyntheticLengths("fixed", 512), SyntheticLengths("fixed", 16), rate=5.0,
                           requests=n, seed=3)


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0, 3.7])
def test_a_scaled_trace_keeps_the_span_and_multiplies_the_rate(factor: float) -> None:
    trace = _trace()
    span = trace[-1].time_s - trace[0].time_s
    scaled = scaled_trace(trace, factor)
    assert scaled[0].time_s >= trace[0].time_s and scaled[-1].time_s <= trace[0].time_s + span + 1e-9
    assert len(scaled) == pytest.approx(len(trace) * factor, rel=0.15)
    assert len({a.request_id for a in scaled}) == len(scaled)
    assert [a.time_s for a in scaled] == sorted(a.time_s for a in scaled)


def test_copies_get_their_own_block_hashes_but_keep_shared_prefixes_shared() -> None:
    shared = extend_chain((), 4, label=1)
    trace = [Arrival(float(i), f"r{i}", 128, 8, shared + extend_chain(shared, 4, label=100 + i), Tier.FREE)
             for i in range(4)]
    copies = scaled_trace(trace, 2.0)
    first, second = [a for a in copies if "~" not in a.request_id], [a for a in copies if "~1" in a.request_id]
    assert first and second
    assert {a.prefix_hashes[:4] for a in first} == {shared}  # the original keeps its own hashes
    assert len({a.prefix_hashes[:4] for a in second}) == 1  # within a copy the prefix stays shared
    assert not set(first[0].prefix_hashes) & set(second[0].prefix_hashes)  # across copies: no false hits


def _prefill_seconds(chunk: int | None, prompt: int = 2048) -> tuple[int, float]:
    """(steps, seconds) a local prefill of `prompt` tokens takes on a simulated `both` worker."""
    profile = WorkerProfile(prefill_fixed_s=0.02, prefill_per_token_s=1e-5, prefill_per_token_sq_s=0.0)
    worker = SimWorker(SimWorkerSpec("w", WorkerRole.BOTH, profile, max_prefill_tokens=2048,
                                     max_prefill_chunk=chunk), random.Random(0), noise=0.0)
    arrival = Arrival(0.0, "a", prompt, 4, extend_chain((), prompt // 16, label=7), Tier.FREE)
    seq = SimSequence(arrival, SLO(1000, 100), output_tokens=4, max_tokens=4, decode_worker="w", prefill_worker=None)
    worker.admit(seq)
    for ready in worker.allocate_waiting():
        worker.enqueue_prefill(ready)
    steps, seconds, now = 0, 0.0, 0.0
    while seq.first_token_at is None:
        duration = worker.start_step(0.0)
        assert duration is not None
        steps, seconds, now = steps + 1, seconds + duration, now + duration
        worker.finish_step(now)
    return steps, seconds


def test_chunked_prefill_takes_a_step_per_chunk_and_pays_each_steps_fixed_cost() -> None:
    whole_steps, whole_s = _prefill_seconds(None)
    chunked_steps, chunked_s = _prefill_seconds(512)
    assert (whole_steps, chunked_steps) == (1, 4)
    assert chunked_s == pytest.approx(whole_s + 3 * 0.02)  # same tokens, three more fixed costs
