"""The simulator's host-memory KV tier (scheduler/sim/prefix_cache.py, worker.py): blocks evicted from the GPU
set are demoted and reported as STORED(host), a host hit comes back with its load time charged, and on a
multi-turn workload whose histories outgrow the GPU cache the tier lowers TTFT as the engine's does."""

from __future__ import annotations

from scheduler.core.cost_model import WorkerProfile
from scheduler.replay import replay
from scheduler.sim.prefix_cache import CacheHit, SimPrefixCache
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival, extend_chain, link_turns
from scheduler.types import SLO, KVEvent, KVEventKind, KVTier, Tier, WorkerRole

BLOCK = 16


def test_an_evicted_block_is_demoted_to_host_and_a_host_hit_is_promoted() -> None:
    cache = SimPrefixCache(2, host_capacity_blocks=2)
    cache.store([1, 2, 3])
    assert cache.drain_events()[-1] == KVEvent(KVEventKind.STORED, 1, KVTier.HOST)  # not EVICTED
    assert cache.match([1, 2]) == CacheHit(blocks=2, host_blocks=1)
    events = cache.drain_events()
    assert KVEvent(KVEventKind.STORED, 1) in events  # back on the GPU
    assert KVEvent(KVEventKind.STORED, 3, KVTier.HOST) in events  # made room for it
    assert cache.match([1, 2]) == CacheHit(blocks=2, host_blocks=0)


def test_a_block_leaving_the_host_tier_too_is_evicted_and_without_a_tier_at_once() -> None:
    tiered = SimPrefixCache(1, host_capacity_blocks=1)
    tiered.store([1, 2, 3])
    assert KVEvent(KVEventKind.EVICTED, 1, KVTier.HOST) in tiered.drain_events()
    plain = SimPrefixCache(1)
    plain.store([1, 2])
    assert plain.drain_events()[-1] == KVEvent(KVEventKind.EVICTED, 1)
    assert plain.match([1]) == CacheHit(0)


def _conversations(count: int, turns: int, gap_s: float) -> list[Arrival]:
    """`count` conversations started together, each turn adding 512 prompt tokens to the whole history."""
    arrivals = []
    for c in range(count):
        hashes: tuple[int, ...] = ()
        for t in range(turns):
            hashes = extend_chain(hashes, 512 // BLOCK + (4 if t else 0), label=1000 * c + t)
            arrivals.append(Arrival(t * gap_s + 0.01 * c, f"c{c}t{t}", len(hashes) * BLOCK, 64, hashes,
                                    Tier.ENTERPRISE, conversation_id=f"c{c}"))
    return link_turns(sorted(arrivals, key=lambda a: a.time_s), BLOCK)


def test_a_host_tier_serves_later_turns_whose_history_the_gpu_cache_evicted() -> None:
    trace = _conversations(count=12, turns=5, gap_s=4.0)
    profile = WorkerProfile()

    def run(host_blocks: int) -> float:
        spec = SimWorkerSpec("w", WorkerRole.BOTH, profile, cache_blocks=256, host_cache_blocks=host_blocks,
                             host_load_s_per_block=0.00005)
        result = replay(trace, [spec], "goodput", SLO(ttft_ms=60_000, tpot_ms=60_000))
        ttft = result.percentile_ms("ttft_s", 50)
        assert ttft is not None and len(result.outcomes) == len(trace)
        return ttft

    assert run(host_blocks=8192) < 0.8 * run(host_blocks=0)
