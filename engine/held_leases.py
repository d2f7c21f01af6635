"""`HeldLeases`: finished prefills' block tables kept alive for a KV transfer, each under a lease.

The prefill side of disaggregation (engine/llm_engine.py's module docstring): a held request's blocks
stay allocated until its owner releases them once the transfer is terminal, or until the lease runs
out (an owner's bug or crash; logged as an error, since a WRITE may still be reading them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.outputs import HeldBlocks

log = logging.getLogger(__name__)


class HeldLeases:
    """Not thread-safe."""

    def __init__(self, block_manager: BlockManager, clock: Callable[[], float]) -> None:
        self._block_manager = block_manager
        self._clock = clock  # the engine's: `HeldBlocks.expires_at` is on it
        self._held: dict[str, HeldBlocks] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def get(self, request_id: str) -> HeldBlocks | None:
        return self._held.get(request_id)

    def hold(self, request_id: str, held: HeldBlocks) -> None:
        """Keep `held.block_ids` (the caller's references, now this table's) until released."""
        self._held[request_id] = held

    @property
    def num_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held.values())

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (its transfer is terminal). Returns whether it was held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._block_manager.free(held.block_ids)
        return True

    def release_expired(self) -> list[str]:
        """Free holds whose lease ran out; returns their ids (each one is an owner's bug or crash)."""
        now = self._clock()
        expired = [rid for rid, held in self._held.items() if held.expires_at <= now]
        for rid in expired:
            log.error("lease of held blocks of %s expired; releasing them", rid)
            self.release(rid)
        return expired
