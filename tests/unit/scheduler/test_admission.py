from collections import Counter

import pytest

from scheduler.core.admission import AdmissionConfig, AdmissionQueue
from scheduler.types import SLO, Tier

ENTERPRISE, PLUS, FREE = Tier.ENTERPRISE, Tier.PLUS, Tier.FREE
LONG_SLO = SLO(ttft_ms=60_000, tpot_ms=100)


def serve(queue: AdmissionQueue, n: int) -> list[str]:
    served = []
    for _ in range(n):
        entry = queue.peek()
        assert entry is not None
        served.append(queue.pop(entry.request.tier).request.request_id)
    return served


def fill(queue: AdmissionQueue, make_request, tier: Tier, n: int, now: float = 0.0) -> None:
    for i in range(n):
        assert queue.push(make_request(f"{tier.value}-{i}", tier=tier, slo=LONG_SLO), now)


def test_contended_capacity_is_shared_by_tier_weight(make_request) -> None:
    queue = AdmissionQueue()
    for tier in Tier:
        fill(queue, make_request, tier, 30)
    served = Counter(rid.split("-")[0] for rid in serve(queue, 30))
    assert served == {"enterprise": 18, "plus": 9, "free": 3}  # weights 6:3:1


def test_ties_go_to_the_heavier_tier_and_fifo_holds_within_a_tier(make_request) -> None:
    queue = AdmissionQueue()
    fill(queue, make_request, FREE, 2)
    fill(queue, make_request, ENTERPRISE, 2)
    assert serve(queue, 2) == ["enterprise-0", "enterprise-1"]


def test_a_tier_that_was_idle_cannot_burst_on_banked_credit(make_request) -> None:
    queue = AdmissionQueue()
    fill(queue, make_request, ENTERPRISE, 60)
    serve(queue, 60)  # enterprise's pass is now far ahead; free had nothing queued meanwhile
    fill(queue, make_request, FREE, 5)
    fill(queue, make_request, ENTERPRISE, 60)
    first_seven = serve(queue, 7)
    assert sum(rid.startswith("free") for rid in first_seven) == 1


def test_requests_expire_at_the_tier_maximum(make_request) -> None:
    queue = AdmissionQueue(AdmissionConfig(max_queue_s={ENTERPRISE: 10.0, PLUS: 5.0, FREE: 2.0}))
    fill(queue, make_request, FREE, 1, now=0.0)
    fill(queue, make_request, ENTERPRISE, 1, now=0.0)
    assert queue.pop_expired(1.9) == []
    assert [e.request.request_id for e in queue.pop_expired(2.1)] == ["free-0"]
    assert len(queue) == 1


def test_requests_expire_once_their_ttft_target_has_passed(make_request) -> None:
    queue = AdmissionQueue()
    queue.push(make_request("r", tier=ENTERPRISE, slo=SLO(ttft_ms=800, tpot_ms=50)), now=0.0)
    assert queue.pop_expired(0.7) == []
    assert [e.request.request_id for e in queue.pop_expired(0.9)] == ["r"]


def test_a_full_tier_refuses_and_others_still_accept(make_request) -> None:
    queue = AdmissionQueue(AdmissionConfig(max_depth=2))
    fill(queue, make_request, FREE, 2)
    assert not queue.push(make_request("free-x", tier=FREE), 0.0)
    assert queue.push(make_request("ent-x", tier=ENTERPRISE), 0.0)


def test_remove_cancels_a_queued_request(make_request) -> None:
    queue = AdmissionQueue()
    fill(queue, make_request, PLUS, 3)
    assert queue.remove("plus-1") is not None
    assert "plus-1" not in queue
    assert serve(queue, 2) == ["plus-0", "plus-2"]
    assert queue.remove("plus-1") is None


def test_config_demands_every_tier(make_request) -> None:
    with pytest.raises(ValueError, match="free"):
        AdmissionConfig(tier_weights={ENTERPRISE: 6.0, PLUS: 3.0})
