"""The policy_compare simulator's fit from tapped step samples (lab/experiments/simulate.py) and the
simulated worker's measured decode table (scheduler/sim/spec.py)."""

from __future__ import annotations

import random

import pytest

from lab.experiments.simulate import host_speeds
from scheduler.calibration.step_fit import FittedWorker, decode_table, fit_workers, rebuild_steps
from scheduler.core.cost_model import WorkerProfile
from scheduler.sim.host import STEADY, HostSpeed
from scheduler.sim.sequence import SimSequence
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, Tier, WorkerRole

PROFILE = WorkerProfile(prefill_fixed_s=0.1, prefill_per_token_s=0.003, prefill_per_token_sq_s=0.0,
                        decode_fixed_s=0.05, decode_per_seq_s=0.01, decode_per_context_token_s=0.0)


def _decode(batch: int, seconds: float) -> list[object]:
    return ["decode", 0.0, batch, 100 * batch, seconds]


def test_decode_table_is_the_median_per_batch_and_interpolates_sparse_sizes() -> None:
    rows = [_decode(1, s) for s in (0.08, 0.07, 0.09, 0.08, 0.08)] + [_decode(3, 0.18)] * 5 + [_decode(2, 9.0)] * 2
    assert decode_table(rebuild_steps(rows)) == pytest.approx((0.08, 0.13, 0.18))  # batch 2: 2 samples, too few


def test_decode_table_is_empty_without_enough_decode_steps() -> None:
    assert decode_table(rebuild_steps([_decode(1, 0.08)] * 4 + [["prefill", 0.0, 50, 0, 0.3]] * 9)) == ()


def test_a_worker_without_pure_prefills_gets_its_prefill_cost_from_the_others() -> None:
    prefills = [["prefill", 0.0, n, 0, 0.1 + 0.003 * n] for n in range(30, 100, 5)]
    decodes = [_decode(b, 0.05 + 0.01 * b) for b in (1, 2, 3, 4) for _ in range(5)]
    fitted = fit_workers({"a": rebuild_steps(decodes), "b": rebuild_steps(prefills + decodes)})
    for worker in ("a", "b"):
        profile = fitted[worker].profile
        assert profile.prefill_fixed_s + 64 * profile.prefill_per_token_s == pytest.approx(0.1 + 0.003 * 64, rel=1e-3)
        assert fitted[worker].decode_step_s == pytest.approx((0.06, 0.07, 0.08, 0.09))


def test_too_few_steps_to_fit_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        fit_workers({"a": rebuild_steps([_decode(1, 0.08)] * 3)})


def _worker(cls: type[SimWorker], table: tuple[float, ...] = ()) -> SimWorker:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, max_batch=8, decode_step_s=table)
    return cls(spec, random.Random(0), 0.0)


def _sequence(worker: SimWorker, i: int, prefill: bool) -> SimSequence:
    arrival = Arrival(0.0, f"r{i}", 64, 8, extend_chain((), 4, label=i), Tier.FREE)
    seq = SimSequence(arrival, SLO(1000, 100), 8, 8, decode_worker="w", prefill_worker=None)
    worker.admit(seq)
    for ready in worker.allocate_waiting():
        if prefill:
            worker.enqueue_prefill(ready)
    return seq


def _decoding(worker: SimWorker, batch: int) -> None:
    for i in range(batch):
        worker.join(_sequence(worker, i, prefill=False), 0.0)


def test_the_decode_table_prices_the_batches_it_covers_and_the_profile_the_rest() -> None:
    worker = _worker(SimWorker, table=(0.08, 0.14, 0.175))
    _decoding(worker, 3)
    assert worker.start_step(0.0) == pytest.approx(0.175)
    assert worker.spec.decode_truth_s(5, 640) == pytest.approx(PROFILE.decode_step_s(5, 640))


def test_a_non_positive_decode_table_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, decode_step_s=(0.08, 0.0))


def test_a_mixed_step_pays_its_share_of_the_decode_part() -> None:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, max_batch=8, decode_step_s=(0.08, 0.14),
                         mixed_decode_share=0.25)
    worker = SimWorker(spec, random.Random(0), 0.0)
    _decoding(worker, 2)
    _sequence(worker, 9, prefill=True)
    assert worker.start_step(0.0) == pytest.approx(0.1 + 0.003 * 64 + 0.25 * 0.14)


def test_a_mixed_decode_share_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="mixed_decode_share"):
        SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, mixed_decode_share=1.5)


def test_host_speed_takes_the_factor_of_the_window_and_the_nearest_one_outside_them() -> None:
    speed = HostSpeed(window_s=5.0, factors=(1.0, 1.2, 0.9))
    assert [speed.at(t) for t in (-1.0, 0.0, 4.99, 5.0, 12.0, 99.0)] == [1.0, 1.0, 1.0, 1.2, 0.9, 0.9]
    assert STEADY.at(42.0) == 1.0
    with pytest.raises(ValueError, match="positive"):
        HostSpeed(factors=(1.0, 0.0))


def test_a_step_in_a_slower_window_takes_that_much_longer_and_its_sample_says_so() -> None:
    spec = SimWorkerSpec("w", WorkerRole.BOTH, PROFILE, max_batch=8, decode_step_s=(0.08, 0.14),
                         host_speed=HostSpeed(window_s=5.0, factors=(1.0, 1.25)))
    worker = SimWorker(spec, random.Random(0), 0.0)
    _decoding(worker, 2)
    assert worker.start_step(1.0) == pytest.approx(0.14)
    worker.finish_step(1.14)
    assert worker.start_step(6.0) == pytest.approx(1.25 * 0.14)
    _, samples, _ = worker.heartbeat(6.2)
    assert [s.seconds for s in samples] == pytest.approx([0.14, 1.25 * 0.14])


def test_host_speeds_are_each_windows_median_step_over_the_fit_with_gaps_from_the_nearest() -> None:
    fitted = {w: FittedWorker(PROFILE, (0.08, 0.14), noise=0.1, steps=100, mean_abs_rel_err=0.1) for w in "ab"}
    t0 = 100.0  # the first request reached the scheduler then: the replay's zero
    rows = ([["decode", t0 + 1.0, 1, 80, s] for s in (0.08, 0.08, 0.088)]  # window 0: x1.0
            + [["decode", t0 + 6.0, 2, 160, 0.14 * 1.3]] * 2  # window 1: too few steps
            + [["decode", t0 + 12.0, 2, 160, s] for s in (0.14 * 1.2, 0.14 * 1.25, 0.14 * 1.2)]  # window 2
            + [["decode", t0 - 3.0, 1, 80, 0.5]] * 3  # before the first request: not the replay's
            + [["prefill", t0 + 1.0, 64, 4096, 0.4]] * 3)
    tap = {"routes": [{"t": t0 + 2.0}, {"t": t0}], "samples": {"a": rows, "b": [["prefill", t0, 64, 4096, 0.4]]}}
    speeds = host_speeds(tap, fitted)
    assert speeds["a"].factors == pytest.approx((1.0, 1.0, 1.2))  # window 1 ties: the earlier neighbour
    assert speeds["b"] is STEADY  # no decode steps: nothing to say about its host
