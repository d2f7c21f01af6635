"""The interface between the batcher and whatever proposes draft tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class DraftProposer(ABC):
    """Proposes draft tokens for a decoding sequence. Host-only (no torch), called by the batcher.

    Callers may rely on: `propose` never returns more than `k` tokens; a proposer may keep
    per-request state, which `forget` drops (the batcher calls it once a request leaves). Not
    thread-safe, like the batcher that owns it.
    """

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that likely follow `token_ids` (prompt + output so far); () for none."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """Drop any state kept for `request_id` (no-op when there is none)."""
