"""Prefill siting by predicted cost (scheduler/core/prefill_site.py), on the test cost models."""

from __future__ import annotations

import pytest

from scheduler.core.placement import evaluate
from scheduler.core.prefill_site import PrefillSiting, SitingConfig
from scheduler.types import SLO, SiteReason, WorkerRole

PREFILL, BOTH = WorkerRole.PREFILL, WorkerRole.BOTH


def test_an_idle_decode_worker_prefills_locally_because_nothing_runs_there(make_request, make_load, make_view):
    req = make_request(prompt=4096)
    view = make_view([make_load("d0"), make_load("p0", PREFILL)])
    choice = PrefillSiting().choose(req, view, view.decode_workers()[0])
    assert (choice.placement.prefill, choice.reason) == (None, SiteReason.LOCAL_CHEAPER)


def test_a_busy_prefill_fleet_keeps_the_prompt_local(make_request, make_load, make_view):
    req = make_request(prompt=4096)
    busy = make_load("p0", PREFILL, queued_prefill_tokens=200_000, queued_prefill_requests=50)
    view = make_view([make_load("d0", batch=8), busy])
    choice = PrefillSiting().choose(req, view, view.decode_workers()[0])
    assert (choice.placement.prefill, choice.reason) == (None, SiteReason.PREFILL_FLEET_BUSY)


def test_a_both_worker_never_takes_a_remote_prefill(make_request, make_load, make_view):
    req = make_request(prompt=4096)
    view = make_view([make_load("b0", BOTH, batch=8), make_load("p0", PREFILL)])
    choice = PrefillSiting().choose(req, view, view.decode_workers()[0])
    assert (choice.placement.prefill, choice.reason) == (None, SiteReason.NO_PREFILL_WORKER)


def test_a_local_prefill_that_would_break_the_batch_tpot_goes_remote_even_when_slower(
    make_request, make_load, make_view
):
    # The batch's step is ~11 ms and its tightest target 20 ms: 2k tokens of local compute spread
    # over 32 remaining tokens adds ~3 ms per token, fine; 8k tokens adds ~13 ms, not.
    req = make_request(prompt=8192, slo=SLO(ttft_ms=60_000, tpot_ms=20))
    decode = make_load("d0", batch=8, tightest_tpot_ms=20.0)
    view = make_view([decode, make_load("p0", PREFILL)])
    local = evaluate(req, view, decode, None)
    assert local.added_tpot_s > 0.005 and not local.meets(req)
    choice = PrefillSiting().choose(req, view, decode)
    assert choice.placement.prefill is not None and choice.placement.meets(req)


def test_the_interference_weight_zero_prices_only_ttft(make_request, make_load, make_view):
    req = make_request(prompt=4096, slo=SLO(ttft_ms=60_000, tpot_ms=1000))
    view = make_view([make_load("d0", batch=8), make_load("p0", PREFILL)])
    decode = view.decode_workers()[0]
    assert PrefillSiting().choose(req, view, decode).placement.prefill is not None
    blind = PrefillSiting(SitingConfig(interference_weight=0.0)).choose(req, view, decode)
    assert blind.placement.prefill is None  # no hop, no hand-off: a faster TTFT


def test_the_hand_off_waits_longer_next_to_a_larger_decode_batch(make_request, make_load, make_view):
    req = make_request(prompt=2048)
    view = make_view([make_load("d0"), make_load("d1", batch=64), make_load("p0", PREFILL)])
    p0 = view.prefill_workers()[0]
    idle, busy = (evaluate(req, view, d, p0).ttft_s for d in view.decode_workers())
    assert busy - idle == pytest.approx(view.cost("d1").decode_step_s(64, 0))


def test_the_remote_pool_is_the_fastest_prefill_workers_counting_their_own_cache(
    make_request, make_load, make_view
):
    req = make_request(prompt=4096)
    loads = [
        make_load("d0"),
        make_load("p0", PREFILL, queued_prefill_tokens=8192, queued_prefill_requests=2),
        make_load("p1", PREFILL),
        make_load("p2", PREFILL, queued_prefill_tokens=1024, queued_prefill_requests=1),
        make_load("p3", PREFILL, queued_prefill_tokens=1024, queued_prefill_requests=1),
    ]
    view = make_view(loads, cached={"p3": req.prefix_hashes})
    pool = PrefillSiting(SitingConfig(remote_candidates=2)).remote_pool(req, view)
    assert [side.worker.worker_id for side in pool] == ["p3", "p1"]
    assert [side.worker.worker_id for side in PrefillSiting().remote_pool(req, view)] == ["p3"]


def test_siting_config_is_validated() -> None:
    with pytest.raises(ValueError, match="remote_candidates"):
        SitingConfig(remote_candidates=0)
