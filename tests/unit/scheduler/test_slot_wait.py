"""The wait for a decode slot: how far the running sequences have got, and who is ahead in line."""

import pytest

from scheduler.core.batch_forecast import slot_wait_s
from scheduler.core.cost_model import CostModel
from scheduler.core.registry import WorkerRegistry
from scheduler.types import WorkerRole
from tests.unit.scheduler.conftest import FAST, load, snapshot

STEP = CostModel(FAST).decode_step_s(1, 0)  # one sequence, no context: what each slot-wait step costs


def one_slot(running: int, ahead: int, remaining: int = 0, age_s: float = 0.0) -> float:
    """Slot wait (in steps) on a one-slot worker running `running` sequences that may still
    generate `remaining` tokens, with `ahead` sequences waiting or routed since, for a 20-token request."""
    snap = snapshot("w", WorkerRole.BOTH, max_num_seqs=1, running_seqs=running, queue_depth=0,
                    running_remaining_tokens=remaining)
    worker = load("w", WorkerRole.BOTH, snapshot=snap, decode_batch=running + ahead, heartbeat_age_s=age_s)
    return slot_wait_s(worker, CostModel(FAST), max_tokens=20) / STEP


def test_a_free_slot_means_no_wait() -> None:
    assert one_slot(running=0, ahead=0) == 0.0


def test_a_sequence_routed_since_the_heartbeat_has_not_started_so_its_whole_life_is_ahead() -> None:
    # The old guess took it for half done: the CPU policy runs' one-slot TTFTs came out ~1 s late.
    assert one_slot(running=0, ahead=1) == pytest.approx(20)


def test_a_reported_remaining_length_replaces_the_half_done_guess() -> None:
    assert one_slot(running=1, ahead=0) == pytest.approx(10)  # unknown: half of this request's life
    assert one_slot(running=1, ahead=0, remaining=18) == pytest.approx(18)
    assert one_slot(running=1, ahead=1, remaining=18) == pytest.approx(18 + 20)  # then a whole life


def test_steps_run_since_the_heartbeat_count_as_progress() -> None:
    assert one_slot(running=1, ahead=0, remaining=18, age_s=5 * STEP) == pytest.approx(13)
    assert one_slot(running=1, ahead=0, remaining=18, age_s=100 * STEP) == 0.0  # it should be done by now


def test_on_several_slots_the_running_sequences_free_theirs_spread_around_their_mean_remaining() -> None:
    snap = snapshot("w", WorkerRole.BOTH, max_num_seqs=3, running_seqs=3, running_remaining_tokens=3 * 8)
    worker = load("w", WorkerRole.BOTH, snapshot=snap, decode_batch=3 + 4)
    # Frees after 4, 8 and 12 steps (spread over (0, 16], mean 8); four ahead of us take them in that
    # order and the first again, so we get the second slot after one whole 20-step life.
    step = CostModel(FAST).decode_step_s(3, 0)
    assert slot_wait_s(worker, CostModel(FAST), max_tokens=20) == pytest.approx(step * (8 + 20))


def test_a_slot_freed_while_others_wait_goes_to_the_first_in_line() -> None:
    # Two slots, one running (8 tokens left), two routed since: they take the free slot and then the
    # running one's; the third in line (us) waits for the first of them to finish its whole life.
    snap = snapshot("w", WorkerRole.BOTH, max_num_seqs=2, running_seqs=1, running_remaining_tokens=8)
    worker = load("w", WorkerRole.BOTH, snapshot=snap, decode_batch=1 + 2)
    step = CostModel(FAST).decode_step_s(2, 0)
    assert slot_wait_s(worker, CostModel(FAST), max_tokens=20) == pytest.approx(step * 20)


def test_the_registry_tells_how_old_the_heartbeat_behind_a_load_is() -> None:
    registry = WorkerRegistry(heartbeat_timeout_s=10.0, dispatch_grace_s=0.0)
    registry.update(snapshot("w"), now=100.0)
    assert registry.loads(now=100.0)[0].heartbeat_age_s == 0.0
    assert registry.loads(now=101.5)[0].heartbeat_age_s == pytest.approx(1.5)


def test_sequences_waiting_in_the_worker_count_at_the_batchs_mean_context() -> None:
    """They are reported by count only; at zero context they diluted the mean, and a one-slot worker with
    two waiting priced its slot waits at a third of the context it ran (pass S, docs/benchmarks.md)."""
    registry = WorkerRegistry(heartbeat_timeout_s=10.0, dispatch_grace_s=0.0)
    registry.update(snapshot("w", WorkerRole.BOTH, max_num_seqs=1, running_seqs=1, running_context_tokens=90,
                             queue_depth=2, inflight_prefill_tokens=115, inflight_prefill_requests=2), now=0.0)
    assert registry.load("w", now=0.0).context_tokens == 270
    registry.update(snapshot("idle", WorkerRole.BOTH, max_num_seqs=1, queue_depth=2, inflight_prefill_tokens=120,
                             inflight_prefill_requests=2), now=0.0)
    assert registry.load("idle", now=0.0).context_tokens == 120  # none running: the pending prompts' mean
    registry.update(snapshot("busy", WorkerRole.DECODE, running_seqs=3, running_context_tokens=3000,
                             waiting_for_remote_kv=1), now=0.0)
    assert registry.load("busy", now=0.0).context_tokens == 4000
