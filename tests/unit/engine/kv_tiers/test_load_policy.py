"""LoadCostModel: a block is loaded only when its measured load time beats its measured recompute."""

from __future__ import annotations

from engine.kv_tiers.load_policy import LoadCostModel
from engine.kv_tiers.types import KVTier

_MIB = 1 << 20


def model(min_speedup: float = 1.0) -> LoadCostModel:
    # 1 MiB blocks of 16 tokens; host 10 GiB/s, disk 100 MiB/s before any measurement
    return LoadCostModel({KVTier.HOST: 10 * 1024 * _MIB, KVTier.DISK: 100 * _MIB}, _MIB, 16, min_speedup)


def test_loads_are_taken_until_the_prefill_rate_is_known() -> None:
    assert model().worth_loading(KVTier.DISK)


def test_a_tier_slower_than_the_prefill_is_skipped_and_a_faster_one_taken() -> None:
    m = model()
    m.observe_prefill(16_000, 1.0)  # 1 ms per 16-token block; host ~0.1 ms, disk ~10 ms per block
    assert m.worth_loading(KVTier.HOST) and not m.worth_loading(KVTier.DISK)


def test_measured_load_bandwidth_moves_the_decision() -> None:
    m = model()
    m.observe_prefill(1_600, 1.0)  # 10 ms per block: disk at 100 MiB/s (10 ms) is not faster
    assert not m.worth_loading(KVTier.DISK)
    for _ in range(20):
        m.observe_load(KVTier.DISK, 100 * _MIB, 0.1)  # measured 1000 MiB/s: 1 ms per block
    assert m.worth_loading(KVTier.DISK)


def test_min_speedup_asks_for_a_margin_and_zero_always_loads() -> None:
    m = model(min_speedup=20.0)
    m.observe_prefill(16_000, 1.0)  # recompute 1 ms; host load ~0.1 ms: 10x faster, not 20x
    assert not m.worth_loading(KVTier.HOST)
    always = model(min_speedup=0.0)
    always.observe_prefill(16_000_000, 1.0)
    assert always.worth_loading(KVTier.DISK)


def test_samples_too_short_to_time_are_ignored() -> None:
    m = model()
    m.observe_load(KVTier.HOST, _MIB, 0.0)
    m.observe_prefill(16, 0.0)
    assert m.bandwidth(KVTier.HOST) == 10 * 1024 * _MIB and m.prefill_tokens_per_s is None
