"""Role switching in the scheduler core: drain (no new placements), switch when idle, done on report."""

from __future__ import annotations

import pytest

from scheduler.core.fleet_signals import fleet_signals
from scheduler.core.policies import RoundRobinPolicy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import SwitchState, WorkerRole

DECODE, PREFILL, BOTH = WorkerRole.DECODE, WorkerRole.PREFILL, WorkerRole.BOTH


@pytest.fixture
def scheduler(make_snapshot) -> Scheduler:
    core = Scheduler(RoundRobinPolicy(), SchedulerConfig(heartbeat_timeout_s=30.0, dispatch_grace_s=0.05))
    for worker_id in ("a", "b"):
        core.register(make_snapshot(worker_id, DECODE), now=0.0)
    return core


def test_a_draining_worker_gets_no_new_requests(scheduler, make_request) -> None:
    assert scheduler.set_role("a", PREFILL, now=1.0).state is SwitchState.SWITCHING  # idle: no drain needed
    decisions = [scheduler.route(make_request(f"r{i}"), now=1.0) for i in range(4)]
    assert {d.decode_worker_id for d in decisions} == {"b"}


def test_a_busy_worker_drains_before_it_is_told_its_new_role(scheduler, make_snapshot, make_request) -> None:
    placed = [scheduler.route(make_request(f"r{i}"), now=1.0) for i in range(2)]
    on_a = next(d.request_id for d in placed if d.decode_worker_id == "a")
    assert scheduler.set_role("a", BOTH, now=1.1).state is SwitchState.DRAINING
    scheduler.on_heartbeat(make_snapshot("a", DECODE, running_seqs=1), [], [], now=1.2)
    assert scheduler.pending_role("a") is None  # still running its request
    scheduler.on_finished(on_a, now=1.3)
    scheduler.on_heartbeat(make_snapshot("a", DECODE), [], [], now=1.4)
    assert scheduler.pending_role("a") is BOTH
    scheduler.on_heartbeat(make_snapshot("a", BOTH), [], [], now=1.5)
    assert scheduler.pending_role("a") is None and scheduler.role_switches() == []
    decisions = [scheduler.route(make_request(f"s{i}"), now=1.5) for i in range(4)]
    assert {d.decode_worker_id for d in decisions} == {"a", "b"}  # routable again, as `both`


def test_a_placement_not_yet_in_a_heartbeat_keeps_the_worker_draining(scheduler, make_snapshot, make_request):
    placed = [scheduler.route(make_request(f"r{i}"), now=1.0) for i in range(2)]
    assert "a" in {d.decode_worker_id for d in placed}
    scheduler.set_role("a", PREFILL, now=1.0)
    scheduler.on_heartbeat(make_snapshot("a", DECODE), [], [], now=1.01)  # sent before the request arrived
    assert scheduler.pending_role("a") is None


def test_asking_for_the_current_role_is_done_at_once(scheduler) -> None:
    assert scheduler.set_role("a", DECODE, now=1.0).state is SwitchState.DONE
    assert scheduler.role_switches() == []


def test_an_unknown_worker_cannot_be_switched(scheduler) -> None:
    with pytest.raises(KeyError):
        scheduler.set_role("nobody", PREFILL, now=1.0)


def test_a_worker_that_dies_while_switching_is_forgotten(scheduler) -> None:
    scheduler.set_role("a", PREFILL, now=1.0)
    assert scheduler.live_worker_ids(now=40.0) == []
    assert scheduler.role_switches() == []


def test_fleet_signals_sum_backlog_and_kv_use_per_role(make_load, make_view) -> None:
    loads = [
        make_load("d0", DECODE, batch=4, free_blocks=250),
        make_load("d1", DECODE, batch=2, free_blocks=750),
        make_load("p0", PREFILL, queued_prefill_tokens=4096, queued_prefill_requests=2),
    ]
    view = make_view(loads)
    signals = {s.role: s for s in fleet_signals(loads, {w.worker_id: view.cost(w.worker_id) for w in loads})}
    assert (signals[DECODE].workers, signals[DECODE].kv_usage, signals[DECODE].decode_seqs) == (2, 0.5, 6)
    prefill = signals[PREFILL]
    assert prefill.prefill_backlog_tokens == 4096
    assert prefill.queue_s == pytest.approx(view.cost("p0").prefill_backlog_s(4096, 2))
    assert (signals[BOTH].workers, signals[BOTH].queue_s) == (0, 0.0)
