import random

from scheduler.core.prefix_index import PrefixIndex
from scheduler.types import KVEvent, KVEventKind, KVTier

STORED, EVICTED = KVEventKind.STORED, KVEventKind.EVICTED


def stored(*hashes: int) -> list[KVEvent]:
    return [KVEvent(STORED, h) for h in hashes]


def test_match_counts_leading_stored_blocks() -> None:
    index = PrefixIndex()
    index.apply("w1", stored(10, 11, 12))
    assert index.match("w1", [10, 11, 12, 13]) == 3
    assert index.match("w1", [10, 99, 12]) == 1
    assert index.match("w1", [99, 10]) == 0
    assert index.match("w2", [10]) == 0


def test_evicted_block_cuts_the_match_there() -> None:
    index = PrefixIndex()
    index.apply("w1", stored(10, 11, 12))
    index.apply("w1", [KVEvent(EVICTED, 11)])
    assert index.match("w1", [10, 11, 12]) == 1
    assert index.holders(11) == frozenset()


def test_events_apply_in_order() -> None:
    index = PrefixIndex()
    index.apply("w1", [KVEvent(STORED, 5), KVEvent(EVICTED, 5), KVEvent(STORED, 5)])
    assert index.match("w1", [5]) == 1


def test_holders_lists_every_worker_with_the_block() -> None:
    index = PrefixIndex()
    index.apply("w1", stored(1, 2))
    index.apply("w2", stored(1))
    assert index.holders(1) == {"w1", "w2"}
    assert index.holders(2) == {"w1"}


def test_drop_worker_forgets_its_blocks_only() -> None:
    index = PrefixIndex()
    index.apply("w1", stored(1, 2))
    index.apply("w2", stored(1))
    index.drop_worker("w1")
    assert index.match("w1", [1, 2]) == 0
    assert index.holders(1) == {"w2"}
    assert index.num_blocks("w1") == 0


def test_match_all_agrees_with_match_for_every_worker_through_evictions_and_holes() -> None:
    rng = random.Random(7)
    index = PrefixIndex()
    chain = list(range(100, 140))
    for worker in range(12):
        held = chain[: rng.randint(0, len(chain))]
        events = stored(*held)
        events += [KVEvent(EVICTED, h) for h in rng.sample(held, k=min(len(held), rng.randint(0, 3)))]
        index.apply(f"w{worker}", events)
    for prompt in (chain, chain[:5], chain[:1], [], [999, *chain], [*chain[:10], 999, *chain[10:]]):
        matches = index.match_all(prompt)
        for worker in range(12):
            assert matches.get(f"w{worker}", 0) == index.match(f"w{worker}", prompt)
        assert all(count > 0 for count in matches.values())  # only holders of the first block listed


def test_a_block_demoted_to_host_still_counts_and_one_on_disk_does_not() -> None:
    index = PrefixIndex()
    index.apply("w1", stored(10, 11, 12))
    index.apply("w1", [KVEvent(STORED, 11, KVTier.HOST)])  # demoted: loading it is far cheaper than a prefill
    assert index.match("w1", [10, 11, 12]) == 3
    index.apply("w1", [KVEvent(STORED, 11, KVTier.DISK)])  # a disk load costs about a recompute
    assert index.match("w1", [10, 11, 12]) == 1 and index.match_all([10, 11, 12]) == {"w1": 1}
    index.apply("w1", [KVEvent(STORED, 11, KVTier.GPU)])  # promoted back
    assert index.match("w1", [10, 11, 12]) == 3
