"""A simulated worker reports step samples as a real one does: pure prefill and pure decode steps only
(services/worker/heartbeat.py: a mixed step's time would be learnt twice, once by each cost model)."""

from __future__ import annotations

import random

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimSequence, SimWorker, SimWorkerSpec
from scheduler.types import SLO, DecodeSample, PrefillSample, Tier, WorkerRole


def _seq(rid: str, label: int, output_tokens: int = 8) -> SimSequence:
    arrival = Arrival(0.0, rid, 64, output_tokens, extend_chain((), 4, label=label), Tier.ENTERPRISE)
    return SimSequence(arrival, SLO(1000, 100), output_tokens, output_tokens, decode_worker="w", prefill_worker=None)


def _step(worker: SimWorker, now: float) -> list[type]:
    assert worker.start_step(now) is not None
    worker.finish_step(now + 1.0)
    _, samples, _ = worker.heartbeat(now + 1.0)
    return [type(s) for s in samples]


def test_pure_steps_report_one_sample_of_their_kind_and_a_mixed_step_reports_none() -> None:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile(), max_batch=4, max_prefill_chunk=512)
    worker = SimWorker(spec, random.Random(0), 0.0)
    first = _seq("first", 0)
    worker.admit(first)
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)

    assert _step(worker, 0.0) == [PrefillSample]  # only the prompt: a pure prefill step (then it decodes)
    assert _step(worker, 1.0) == [DecodeSample]  # only the running sequence

    second = _seq("second", 1)
    worker.admit(second)
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)
    assert _step(worker, 2.0) == []  # the prompt's chunk rides in the decode step: not reported
