"""A simulated worker reports step samples as a real one does: one per step, of the step's kind
(services/worker/heartbeat.py), a mixed step's time with its decode part at the spec's share, and the
served step's time, serving cost included (engine/async_engine.py)."""

from __future__ import annotations

import random

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.sequence import SimSequence
from scheduler.sim.serving import ServingCost
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
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


def _worker_with_a_prompt(serving: ServingCost) -> SimWorker:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, WorkerProfile(), max_batch=4, serving=serving)
    worker = SimWorker(spec, random.Random(0), 0.0)
    worker.admit(_seq("first", 0))
    (ready,) = worker.allocate_waiting()
    worker.enqueue_prefill(ready)
    return worker


def test_a_sample_is_the_served_step_serving_cost_included() -> None:
    worker = _worker_with_a_prompt(ServingCost(per_step_s=0.002, per_seq_s=0.0001))
    for now in (0.0, 1.0):  # the prompt's step, then a decode step
        seconds = worker.start_step(now)
        worker.finish_step(now + 1.0)
        (sample,) = worker.heartbeat(now + 1.0)[1]
        assert sample.seconds == seconds
    assert isinstance(sample, DecodeSample)
    assert sample.seconds == pytest.approx(worker.spec.profile.decode_step_s(1, sample.context_tokens) + 0.0021)


def test_samples_carry_only_the_sampled_share_of_the_serving_cost() -> None:
    # workers from before served samples
    worker = _worker_with_a_prompt(ServingCost(per_step_s=0.002, sampled_share=0.0))
    seconds = worker.start_step(0.0)
    worker.finish_step(1.0)
    (sample,) = worker.heartbeat(1.0)[1]
    assert seconds == pytest.approx(sample.seconds + 0.002)
    with pytest.raises(ValueError, match="sampled share"):
        ServingCost(sampled_share=1.5)


def test_a_simulated_pair_counts_requests_as_real_workers_do_and_reports_sequences_awaiting_kv() -> None:
    """The decode worker counts a request when it takes it on, the prefill worker when the job reaches it
    (services/worker/intake.py); a sequence holding blocks for a remote prefill is reported apart from the
    queue, as the engine's `waiting_for_remote_kv`."""
    rng = random.Random(0)
    decode = SimWorker(SimWorkerSpec("d", WorkerRole.DECODE, WorkerProfile(), max_batch=4), rng, 0.0)
    prefill = SimWorker(SimWorkerSpec("p", WorkerRole.PREFILL, WorkerProfile()), rng, 0.0)
    arrival = Arrival(0.0, "r", 64, 8, extend_chain((), 4, label=0), Tier.FREE)
    seq = SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="d", prefill_worker="p")
    decode.admit(seq)
    snapshot, _, _ = decode.heartbeat(0.01)
    assert (snapshot.requests_received, snapshot.queue_depth, snapshot.waiting_for_remote_kv) == (1, 1, 0)
    (ready,) = decode.allocate_waiting()
    assert prefill.heartbeat(0.02)[0].requests_received == 0  # the job has not reached it
    prefill.enqueue_prefill(ready)
    snapshot, _, _ = decode.heartbeat(0.03)
    assert (snapshot.requests_received, snapshot.queue_depth, snapshot.waiting_for_remote_kv) == (1, 0, 1)
    assert prefill.heartbeat(0.03)[0].requests_received == 1
    decode.land(seq, 0.5)
    snapshot, _, _ = decode.heartbeat(0.6)
    assert (snapshot.running_seqs, snapshot.waiting_for_remote_kv) == (1, 0)
