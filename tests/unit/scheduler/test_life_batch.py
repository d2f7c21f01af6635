"""A newcomer's TPOT is priced at the batch it will decode in over its life, not the batch it finds."""

import pytest

from scheduler.core.batch_forecast import life_batch
from scheduler.core.placement import evaluate
from scheduler.core.policies import LeastLoadedPolicy
from scheduler.core.scheduler import Scheduler
from scheduler.types import WorkerRole
from tests.unit.scheduler.conftest import load, request, snapshot, view


def _worker(batch: int, remaining_each: int = 0, arrival_rate: float = 0.0, slots: int | None = None):
    snap = snapshot("w", running_seqs=batch, running_remaining_tokens=remaining_each * batch,
                    max_num_seqs=slots or 0)
    return load("w", batch=batch, snapshot=snap, arrival_rate=arrival_rate)


def test_arrivals_at_the_recent_rate_join_for_half_the_life_on_average() -> None:
    # 64 steps of 0.1 s: 6.4 s of life; 2 arrivals/s stay 3.2 s on average: 6.4 more sequences.
    assert life_batch(_worker(0, arrival_rate=2.0), 0, 64, 0.1) == pytest.approx(6.4)


def test_running_sequences_stay_for_what_their_remaining_length_covers() -> None:
    # Remaining ~U(0, 32] (mean 16) over a 64-step life: each stays 16/64 of it.
    assert life_batch(_worker(8, remaining_each=16), 8, 64, 0.1) == pytest.approx(2.0)
    # Remaining ~U(0, 256] (mean 128): E[min(r, 64)] / 64 = 1 - 64 / 512.
    assert life_batch(_worker(8, remaining_each=128), 8, 64, 0.1) == pytest.approx(8 * (1 - 64 / 512))


def test_unreported_remaining_lengths_keep_the_running_sequences_throughout() -> None:
    assert life_batch(_worker(8), 8, 64, 0.1) == pytest.approx(8.0)


def test_sequences_not_started_stay_and_the_slots_cap_the_batch() -> None:
    waiting = load("w", batch=6, snapshot=snapshot("w", running_seqs=2, running_remaining_tokens=32))
    assert life_batch(waiting, 6, 64, 0.1) == pytest.approx(2 * 16 / 64 + 4)
    assert life_batch(_worker(3, arrival_rate=10.0, slots=8), 3, 64, 0.1) == pytest.approx(7.0)


def test_a_quiet_worker_with_arrivals_predicts_the_slower_tpot_of_the_batch_to_come() -> None:
    req = request(prompt=64, max_tokens=64)
    quiet, filling, draining = _worker(1, 64), _worker(1, 64, arrival_rate=2.0), _worker(8, remaining_each=4)
    found = [evaluate(req, view([w]), w, None).tpot_s for w in (quiet, filling, draining)]
    cost = view([quiet]).cost("w")
    assert found[1] > found[0]
    # The 8 running have ~4 tokens left: 0.5 of them on average beside the newcomer, not 8.
    one, two = cost.decode_step_s(1, 0), cost.decode_step_s(2, 0)
    assert found[2] == pytest.approx(one + 0.5 * (two - one))


def test_the_scheduler_counts_placements_into_the_decode_workers_arrival_rate() -> None:
    scheduler = Scheduler(LeastLoadedPolicy())
    scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
    for i in range(4):
        scheduler.route(request(f"r{i}", prompt=32), now=0.5 * i)
    assert scheduler.worker_loads(2.0)[0].arrival_rate == pytest.approx(2.0, rel=0.15)  # 4 in 2 s
