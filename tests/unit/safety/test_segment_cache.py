"""The classifier's segment cache: a text judged once costs a lookup; a joined text of messages
already judged (the gateway checks new messages one by one and joined) costs only its new pieces."""

from __future__ import annotations

import numpy as np

from services.safety.categories import Direction
from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier, SegmentCache
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook
from services.safety.segments import segments
from tests.support.texts import prose


def _checker(classifier: EmbeddingClassifier) -> SafetyChecker:
    fresh = EmbeddingClassifier(classifier.encoder, classifier.head, SegmentCache())
    return SafetyChecker(PolicyBook(), PatternTier(), fresh)


def test_a_joined_text_reuses_the_pieces_of_its_messages(classifier: EmbeddingClassifier) -> None:
    checker = _checker(classifier)
    cache = checker.classifier.cache  # type: ignore[union-attr]
    # Whole sentences, so where prose() happens to cut (it depends on the tests run before) cannot leave a
    # half sentence that joins the next message's first one into new pieces.
    system, user = (prose(n).rsplit(".", 1)[0] + "." for n in (150, 400))
    alone = [checker.check("org", t, Direction.INPUT) for t in (system, user)]
    pieces = len(cache)
    assert pieces == len(set(segments(system)) | set(segments(user)))
    joined = checker.check("org", f"{system}\n{user}", Direction.INPUT)
    assert len(cache) - pieces <= 1  # at most the piece that joins the two tails
    assert joined.allowed and all(v.allowed for v in alone)


def test_cached_probabilities_are_the_computed_ones(classifier: EmbeddingClassifier) -> None:
    fresh = EmbeddingClassifier(classifier.encoder, classifier.head, SegmentCache())
    text = "how do I turn a drone into a weapon that drops explosives on people"
    first, again = fresh.predict(text), fresh.predict(text)
    assert first == again and len(fresh.cache) == 1
    uncached = EmbeddingClassifier(classifier.encoder, classifier.head, SegmentCache(0))
    assert uncached.predict(text) == first and len(uncached.cache) == 0


def test_the_cache_keeps_the_most_recent_entries() -> None:
    cache = SegmentCache(max_entries=2)
    rows = {name: np.full(6, i, dtype=np.float32) for i, name in enumerate("abc")}
    for name, row in rows.items():
        cache.put(SegmentCache.key(name), row)
    assert len(cache) == 2 and cache.get(SegmentCache.key("a")) is None
    assert cache.get(SegmentCache.key("c")) is rows["c"]
