"""Clients that give up: a request unanswered after the client's timeout counts as timed out (not served),
and the gateway's abort after its detach grace frees the worker for the requests behind it. Without this,
an overloaded worker's queue grew for ever in the simulator, where real clients left it (and the replays
of round-robin under overload put TTFT p90 at ~3x the real one)."""

from __future__ import annotations

import random

import pytest

from scheduler.core.cost_model import WorkerProfile
from scheduler.replay import Clients, ReplayConfig, replay
from scheduler.sim.results import RequestOutcome
from scheduler.sim.sequence import SimSequence
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole

PROFILE = WorkerProfile(prefill_fixed_s=0.01, prefill_per_token_s=1e-4, prefill_per_token_sq_s=0.0,
                        decode_fixed_s=0.02, decode_per_seq_s=0.0, decode_per_context_token_s=0.0,
                        transfer_fixed_s=0.005, transfer_per_token_s=1e-5)
SLOS = SLO(ttft_ms=10_000, tpot_ms=1_000)
ONE_SLOT = [SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, max_batch=1)]


def _arrival(at: float, rid: str, output: int, prompt: int = 100, label: int = 0) -> Arrival:
    return Arrival(at, rid, prompt, output, extend_chain((), prompt // 16, label), Tier.FREE)


# r0 holds the one slot ~1.0 s, r1 would hold it ~2.0 s more, r2 (short) comes while r1 runs.
TRACE = [_arrival(0.0, "r0", 51, label=0), _arrival(0.01, "r1", 101, label=1), _arrival(1.2, "r2", 11, label=2)]


def _outcomes(config: ReplayConfig) -> dict[str, RequestOutcome]:
    return {o.request_id: o for o in replay(TRACE, ONE_SLOT, "round_robin", SLOS, config).outcomes}


def test_patient_clients_wait_behind_the_long_request() -> None:
    outcomes = _outcomes(ReplayConfig(step_noise=0.0))
    assert all(o.ttft_s is not None and not o.timed_out for o in outcomes.values())
    assert outcomes["r2"].ttft_s == pytest.approx(1.9, abs=0.05)  # r1 ends at ~3.06, r2 then takes ~0.04 s


def test_a_client_that_gives_up_is_a_timeout_and_its_abort_frees_the_slot() -> None:
    config = ReplayConfig(step_noise=0.0, clients=Clients(timeout_s=1.5, detach_grace_s=0.5))
    result = replay(TRACE, ONE_SLOT, "round_robin", SLOS, config)
    r0, r1, r2 = result.outcomes
    assert r0.ttft_s is not None and not r0.timed_out
    assert r1.timed_out and r1.ttft_s is None and r1.tpot_s is None and not r1.met_slo
    # r1 is aborted at 1.51 + 0.5 s, mid-step; the step ends without it and r2 takes the slot.
    assert r2.ttft_s == pytest.approx(2.01 + 0.02 - 1.2 + 0.02, abs=0.03) and not r2.timed_out
    assert result.percentile_ms("ttft_s", 100) < 1_100  # r1 counts in no latency
    assert result.goodput == pytest.approx(2 / 3)


def test_an_answer_completed_after_the_client_left_stays_a_timeout() -> None:
    config = ReplayConfig(step_noise=0.0, clients=Clients(timeout_s=0.8, detach_grace_s=5.0))
    [r0] = replay(TRACE[:1], ONE_SLOT, "round_robin", SLOS, config).outcomes  # it ends at ~1.04 s, in the grace
    assert r0.timed_out and r0.ttft_s is None and not r0.met_slo


def _seq(rid: str, decode: str, prefill: str | None = None, prompt: int = 64) -> SimSequence:
    arrival = _arrival(0.0, rid, 8, prompt=prompt)
    return SimSequence(arrival, SLOS, 8, 8, decode_worker=decode, prefill_worker=prefill)


def _worker(worker_id: str, role: WorkerRole = WorkerRole.BOTH, max_batch: int = 4) -> SimWorker:
    return SimWorker(SimWorkerSpec(worker_id, role, PROFILE, total_blocks=64, max_batch=max_batch),
                     random.Random(0), 0.0)


def test_an_abort_mid_step_frees_the_blocks_and_the_step_ends_without_it() -> None:
    worker = _worker("w")
    gone, stays = _seq("gone", "w"), _seq("stays", "w")
    for seq in (gone, stays):
        worker.admit(seq)
    for seq in worker.allocate_waiting():
        worker.enqueue_prefill(seq)
    worker.start_step(0.0)
    worker.abort(gone)
    outcome = worker.finish_step(0.1)
    assert [s.arrival.request_id for s in outcome.first_tokens] == ["stays"]
    snapshot, _, _ = worker.heartbeat(0.1)
    assert snapshot.running_seqs == 1
    assert snapshot.free_blocks == 64 - stays.reserved_blocks


def test_an_aborted_sequence_leaves_the_waiting_queue_for_the_next_one() -> None:
    worker = _worker("w", max_batch=1)
    first, gone, last = _seq("first", "w"), _seq("gone", "w"), _seq("last", "w")
    for seq in (first, gone, last):
        worker.admit(seq)
    assert worker.allocate_waiting() == [first]
    worker.abort(gone)
    worker.abort(first)
    assert worker.allocate_waiting() == [last]


def test_an_abort_during_a_remote_prefill_frees_the_decode_blocks_and_nothing_lands() -> None:
    prefill, decode = _worker("p", WorkerRole.PREFILL), _worker("d", WorkerRole.DECODE)
    seq = _seq("gone", "d", "p", prompt=640)
    decode.admit(seq)
    assert decode.allocate_waiting() == [seq]
    prefill.enqueue_prefill(seq)
    prefill.start_step(0.0)
    prefill.abort(seq)  # either order, same instant
    decode.abort(seq)
    assert prefill.finish_step(0.1).prefilled == []  # no transfer starts
    assert decode.land(seq, 0.2) is None
    snapshot, _, _ = decode.heartbeat(0.2)
    assert snapshot.free_blocks == 64 and snapshot.running_seqs == 0
