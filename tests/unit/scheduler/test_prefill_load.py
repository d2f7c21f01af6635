"""The prefill share: placements' prefill compute forecasts the interference a decoding request meets."""

import math

import pytest

from scheduler.core.placement import evaluate
from scheduler.core.policies import LeastLoadedPolicy
from scheduler.core.prefill_load import MAX_PREFILL_SHARE, DecayingRate, decode_stretch
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.types import WorkerRole
from tests.unit.scheduler.conftest import load, request, snapshot, view


def test_a_steady_stream_reads_as_its_work_per_second() -> None:
    rate = DecayingRate(time_constant_s=5.0, since=0.0, min_window_s=1.0)
    for i in range(400):  # 0.2 s of work every 0.5 s for 200 s: 0.4 s/s
        rate.add(0.2, now=0.5 * i)
    assert rate.value(now=199.5) == pytest.approx(0.4, rel=0.06)


def test_the_rate_decays_once_the_work_stops() -> None:
    rate = DecayingRate(time_constant_s=5.0, since=-1000.0, min_window_s=1.0)  # a long history
    rate.add(1.0, now=0.0)
    assert rate.value(now=0.0) == pytest.approx(0.2)
    assert rate.value(now=5.0) == pytest.approx(0.2 / math.e)
    assert rate.value(now=-1.0) == pytest.approx(0.2)  # an earlier clock reading never inflates it


def test_a_short_history_reads_as_the_rate_it_has_seen_not_as_a_rate_rising_from_zero() -> None:
    rate = DecayingRate(time_constant_s=10.0, since=0.0, min_window_s=1.0)
    for i in range(6):  # 0.25 s of work every 0.5 s: 0.5 s/s from the start
        rate.add(0.25, now=0.5 * i)
    assert rate.value(now=2.75) == pytest.approx(0.5, rel=0.1)  # an unnormalised average reads ~0.12
    rate.restart(now=100.0)
    assert rate.value(now=100.0) == 0.0
    rate.add(0.5, now=100.0)
    assert rate.value(now=100.0) == pytest.approx(0.5 / 10.0 / -math.expm1(-0.1))  # ~0.5: the min window


def test_a_non_positive_time_constant_or_window_is_refused() -> None:
    with pytest.raises(ValueError, match="time_constant_s"):
        DecayingRate(0.0, since=0.0, min_window_s=1.0)
    with pytest.raises(ValueError, match="min_window_s"):
        DecayingRate(1.0, since=0.0, min_window_s=0.0)


def test_decode_steps_stretch_by_the_prefill_share_except_on_one_slot() -> None:
    assert decode_stretch(0.0, None) == 1.0
    assert decode_stretch(0.5, 8) == pytest.approx(2.0)
    assert decode_stretch(0.5, 1) == 1.0  # the next prompt is prefilled only once the slot frees
    assert decode_stretch(5.0, None) == pytest.approx(1 / (1 - MAX_PREFILL_SHARE))  # capped


def test_a_worker_busy_prefilling_predicts_a_slower_tpot_and_slot_wait() -> None:
    quiet = load("w", WorkerRole.BOTH, batch=4, snapshot=snapshot("w", WorkerRole.BOTH, max_num_seqs=4))
    busy = load("w", WorkerRole.BOTH, batch=4, snapshot=snapshot("w", WorkerRole.BOTH, max_num_seqs=4),
                prefill_work_rate=0.5)  # and no prompt count: a share of 0.5 at any step
    req = request(prompt=64)
    before, after = evaluate(req, view([quiet]), quiet, None), evaluate(req, view([busy]), busy, None)
    assert after.tpot_s == pytest.approx(2 * before.tpot_s)
    assert before.wait_s > 0  # all four slots taken: a slot wait
    assert after.wait_s == pytest.approx(2 * before.wait_s)


def _probe_tpot_ms(scheduler: Scheduler, now: float) -> float:
    """The predicted TPOT of a short request on the worker, running one sequence per its heartbeat
    at `now` (not idle: an idle cluster starts its prefill shares afresh)."""
    scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH, running_seqs=1), [], [], now=now)
    decision = scheduler.route(request(f"probe{now}", prompt=32), now=now)
    assert decision.predicted_tpot_ms is not None
    return decision.predicted_tpot_ms


def test_local_prefills_placed_on_a_worker_stretch_its_predicted_tpot_until_they_decay() -> None:
    def fresh() -> Scheduler:
        scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=5.0))
        scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
        return scheduler

    busy = fresh()
    for i in range(10):  # ten 512-token prompts prefilled on "w" within a second
        assert busy.route(request(f"r{i}", prompt=512), now=0.1 * i).decode_worker_id == "w"
    per_prompt = busy.cost_model("w").prefill_s(512, 0)  # whole: fixed part too
    observed = -math.expm1(-2.0 / 5.0)  # one second of history counts as the 2 s minimum window
    share = sum(per_prompt / 5.0 * math.exp(-(1.0 - 0.1 * i) / 5.0) for i in range(10)) / observed
    base = _probe_tpot_ms(fresh(), now=1.0)
    probe = busy.route(request("probe", prompt=32), now=1.0)  # its batch also grows: ten arrivals a second
    assert probe.predicted_tpot_ms is not None and probe.predicted_stretch_ms is not None
    unstretched = probe.predicted_tpot_ms - probe.predicted_stretch_ms
    assert probe.predicted_tpot_ms == pytest.approx(unstretched / (1 - share), rel=0.02)
    assert _probe_tpot_ms(busy, now=60.0) == pytest.approx(base, rel=0.02)


def test_an_idle_cluster_starts_its_prefill_shares_afresh() -> None:
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=10.0, prefill_min_window_s=2.0))
    scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
    for i in range(5):  # a burst, then the worker reports it done
        scheduler.route(request(f"r{i}", prompt=512), now=0.1 * i)
    scheduler.on_heartbeat(snapshot("w", WorkerRole.BOTH), [], [], now=3.0)
    assert scheduler.worker_loads(3.0)[0].prefill_work_rate > 0.0  # the burst is still in the rate
    scheduler.route(request("next", prompt=512), now=3.0)  # the cluster was idle: a new busy period
    per_prompt = scheduler.cost_model("w").prefill_s(512, 0)
    assert scheduler.worker_loads(3.5)[0].prefill_work_rate == pytest.approx(
        per_prompt / 10.0 * math.exp(-0.05) / -math.expm1(-0.2))  # only `next`, over the 2 s minimum


def test_a_decision_says_how_much_of_its_tpot_is_the_prefill_share() -> None:
    scheduler = Scheduler(LeastLoadedPolicy(), SchedulerConfig(prefill_window_s=5.0))
    scheduler.register(snapshot("w", WorkerRole.BOTH), now=0.0)
    first = scheduler.route(request("r0", prompt=512), now=0.0)
    assert first.predicted_stretch_ms == pytest.approx(0.0)  # nothing prefilled there yet
    for i in range(1, 10):
        scheduler.route(request(f"r{i}", prompt=512), now=0.1 * i)
    later = scheduler.route(request("r10", prompt=32), now=1.0)
    assert later.predicted_tpot_ms is not None and later.predicted_stretch_ms is not None
    assert 0.0 < later.predicted_stretch_ms < later.predicted_tpot_ms


def test_a_local_prompt_adds_only_the_interference_the_prefill_share_does_not_already_forecast() -> None:
    def placed(share: float):
        snap = snapshot("w", WorkerRole.BOTH, max_num_seqs=8)
        worker = load("w", WorkerRole.BOTH, batch=2, snapshot=snap, prefill_work_rate=share)
        return evaluate(request(prompt=512, max_tokens=8), view([worker]), worker, None)

    quiet, busy = placed(0.0), placed(0.5)
    interference = view([load("w")]).cost("w").prefill_s(512, 0) / 4  # spread over 8 // 2 tokens
    assert quiet.added_tpot_s == busy.added_tpot_s == pytest.approx(interference)  # what siting weighs
    assert quiet.batch_tpot_s == pytest.approx(quiet.tpot_s + interference)  # a burst on a quiet worker
    step = quiet.tpot_s
    assert busy.tpot_s == pytest.approx(2 * step)  # the share's forecast...
    assert busy.batch_tpot_s == pytest.approx(2 * step + max(interference - step, 0.0))  # ...covers that much
