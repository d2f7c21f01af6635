"""Prompt-lookup drafting: continue the sequence the way it continued last time its suffix appeared.

Summaries, edits, code changes and RAG answers copy long runs of their prompt; when the last n tokens
of a sequence occurred earlier, the tokens that followed them then are a good guess for what comes
next. Longer n-grams are tried first (fewer, better matches).

Cost: each request keeps a table from n-gram to the end of its latest occurrence, extended with
only the tokens added since the last call, so a step's lookup is O(new tokens x n-gram sizes), not
a scan of the whole context.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.speculative.base import DraftProposer


class _NgramTable:
    """One sequence's n-grams -> end (exclusive) of their latest occurrence, for every n-gram that ends
    before the sequence's last token (so each one has at least one continuation token)."""

    def __init__(self) -> None:
        self.latest_end: dict[tuple[int, ...], int] = {}
        self.indexed_to = 0  # n-grams ending at or before this (exclusive end) are in latest_end


class NgramProposer(DraftProposer):
    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._tables: dict[str, _NgramTable] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        if k <= 0:
            return ()
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _NgramTable()
        self._extend(table, token_ids)
        length = len(token_ids)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            end = table.latest_end.get(tuple(token_ids[length - n:]))
            if end is not None:
                return tuple(token_ids[end:end + k])
        return ()

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)

    def _extend(self, table: _NgramTable, token_ids: Sequence[int]) -> None:
        """Index the n-grams ending in (indexed_to, len - 1]: all but those ending at the last token."""
        latest = table.latest_end
        for end in range(table.indexed_to + 1, len(token_ids)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                latest[tuple(token_ids[end - n:end])] = end
        table.indexed_to = max(table.indexed_to, len(token_ids) - 1)
