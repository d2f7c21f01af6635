"""Reservations: a placement's load is charged to its workers until their own heartbeats show it
(scheduler/core/registry.py). Workers that count the requests they take on settle them exactly;
others by the dispatch grace."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler.core.policies import LeastLoadedPolicy
from scheduler.core.registry import Reservation, WorkerRegistry
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import RequestSummary, WorkerRole, WorkerSnapshot

Snap = Callable[..., WorkerSnapshot]
ONE = Reservation(decode_seqs=1, context_tokens=100, blocks=8)


def _registry(make_snapshot: Snap, received: int | None = 0) -> WorkerRegistry:
    registry = WorkerRegistry(heartbeat_timeout_s=10.0, dispatch_grace_s=0.05, dispatch_timeout_s=5.0)
    registry.update(make_snapshot("w", requests_received=received), now=0.0)
    return registry


def test_a_request_still_on_its_way_stays_reserved_however_late_the_heartbeat(make_snapshot: Snap) -> None:
    """The CPU policy runs' case: placed at 29.585 s, a heartbeat at 29.712 s that had not seen it yet
    dropped it (older than the 50-ms grace), and the next decision put a second request on the worker."""
    registry = _registry(make_snapshot)
    registry.reserve("w", ONE, now=1.0)
    registry.update(make_snapshot("w", requests_received=0), now=1.2)  # not there yet
    assert registry.load("w", now=1.2).decode_batch == 1
    registry.update(make_snapshot("w", queue_depth=1, requests_received=1), now=1.4)  # there, and counted
    assert registry.load("w", now=1.4).decode_batch == 1  # once, not twice


def test_a_heartbeat_drops_as_many_of_the_oldest_reservations_as_requests_it_counts(make_snapshot: Snap) -> None:
    registry = _registry(make_snapshot, received=7)
    for i, t in enumerate((1.0, 1.01, 1.02)):
        registry.reserve("w", Reservation(decode_seqs=1, context_tokens=10 ** i), now=t)
    registry.update(make_snapshot("w", running_seqs=2, requests_received=9), now=1.021)  # within the grace
    load = registry.load("w", now=1.021)
    assert (load.decode_batch, load.context_tokens) == (3, 100)  # the newest is still on its way


def test_a_reservation_whose_request_never_arrives_expires_after_the_dispatch_timeout(make_snapshot: Snap) -> None:
    registry = _registry(make_snapshot)
    registry.reserve("w", ONE, now=1.0)
    registry.update(make_snapshot("w", requests_received=0), now=5.9)
    assert registry.holds_work("w")
    registry.update(make_snapshot("w", requests_received=0), now=6.1)
    assert not registry.holds_work("w") and registry.load("w", now=6.1).decode_batch == 0


@pytest.mark.parametrize("received", [None, 3], ids=["no count", "count went back: restarted"])
def test_without_a_usable_count_the_grace_settles_reservations(make_snapshot: Snap, received: int | None) -> None:
    registry = _registry(make_snapshot, received=None if received is None else 10)
    registry.reserve("w", ONE, now=1.0)
    registry.reserve("w", ONE, now=1.18)
    registry.update(make_snapshot("w", running_seqs=1, requests_received=received), now=1.2)
    assert registry.load("w", now=1.2).decode_batch == 2  # the one within the grace stays


def test_sequences_waiting_for_remote_kv_count_in_the_decode_batch(make_snapshot: Snap) -> None:
    registry = _registry(make_snapshot)
    registry.update(make_snapshot("w", running_seqs=2, queue_depth=1, waiting_for_remote_kv=3,
                                  requests_received=6), now=0.5)
    load = registry.load("w", now=0.5)
    assert load.decode_batch == 6 and load.queued_prefill_requests == 1  # their prefill is elsewhere


def test_a_local_placement_is_one_reservation_so_one_counted_request_settles_it(
    make_snapshot: Snap, make_request: Callable[..., RequestSummary]
) -> None:
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(heartbeat_timeout_s=10.0))
    scheduler.register(make_snapshot("w", role=WorkerRole.BOTH, requests_received=0), now=0.0)
    assert scheduler.route(make_request("r0", prompt=512), now=1.0).decode_worker_id == "w"
    scheduler.on_heartbeat(make_snapshot("w", role=WorkerRole.BOTH, queue_depth=1, inflight_prefill_tokens=512,
                                         inflight_prefill_requests=1, requests_received=1), [], [], now=1.01)
    (view,) = scheduler.worker_loads(now=1.01)
    assert (view.decode_batch, view.queued_prefill_requests, view.queued_prefill_tokens) == (1, 1, 512)
