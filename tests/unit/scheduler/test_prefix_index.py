from scheduler.core.prefix_index import PrefixIndex
from scheduler.types import KVEvent, KVEventKind

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
