"""A simulated worker reports step samples as a real one does: one per step, of the step's kind
(services/worker/heartbeat.py), a mixed step's time with its decode part at the spec's share."""

from __future__ import annotations

import random

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimSequence, SimWorker, SimWorkerSpec
from scheduler.types import SLO, DecodeSample, MixedSample, PrefillSample, Tier, WorkerRole


def _seq(rid: str, label: int, output_tokens: int = 8) -> SimSequence:
    arrival = Arrival(0.0, rid, 64, output_tokens, extend_chain((), 4, label=label), Tier.ENTERPRISE)
    return SimSequence(arrival, SLO(1000, 100), output_tokens, output_tokens, decode_worker="w", prefill_worker=None)


def _step(worker: SimWorker, now: float) -> list[object]:
    assert worker.start_step(now) is not None
    worker.finish_step(now + 1.0)
    _, samples, _ = worker.heartbeat(now + 1.0)
    return list(samples)


def test_each_step_reports_one_sample_of_its_kind() -> None:
    profile = WorkerProfile()
    spec = SimWorkerSpec("w", WorkerRole.BOTH, profile, max_batch=4, max_prefill_chunk=512, mixed_decode_share=0.25)
    worker = SimWorker(spec, random.Random(0), 0.0)
    first = _seq("first", 0)
    worker.admit(first)
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)

    assert [type(s) for s in _step(worker, 0.0)] == [PrefillSample]  # only the prompt (then it decodes)
    (decode,) = _step(worker, 1.0)  # only the running sequence
    assert isinstance(decode, DecodeSample)

    second = _seq("second", 1)
    worker.admit(second)
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)
    (mixed,) = _step(worker, 2.0)  # the prompt rides in the decode step
    assert isinstance(mixed, MixedSample)
    assert (mixed.prefill_tokens, mixed.batch_size) == (64, 1)
    prefill = profile.prefill_step_s(64, 64 * 64)
    assert mixed.seconds == pytest.approx(prefill + 0.25 * profile.decode_step_s(1, mixed.context_tokens))
