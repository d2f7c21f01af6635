"""Prefill side of KV streaming: a job's chunk reports (engine thread) become parts of its KV stream.

The engine tells, right after the step that filled them, which blocks of a held prompt's table are
full (engine/chunk_stream.py); `ChunkForwarder` maps them onto the decode worker's blocks of the
order (the blocks the decode worker's own prefix cache serves are skipped) and hands the part to the
KV link thread, which posts the WRITE while the next chunk computes. No event-loop hop on the way:
the engine thread queues the part on the link thread directly.
"""

from __future__ import annotations

import logging
import threading

from engine.chunk_stream import PrefilledBlocks
from services.worker.kv_link import KVLink
from services.worker.prefill_order import PrefillOrder

log = logging.getLogger(__name__)


class ChunkForwarder:
    """`on_prefilled` hook of one streamed job (called on the engine thread; never raises into it).

    An order whose destination follows (the decode worker reserves while we prefill) has no decode
    blocks yet: the reports wait here until `place` (event loop) gives them, then go at once."""

    def __init__(self, link: KVLink, order: PrefillOrder, block_size: int) -> None:
        self._link = link
        self._block_size = block_size
        self._lock = threading.Lock()  # the engine thread reports, the event loop places
        self._order: PrefillOrder | None = None if order.destination_follows else order
        self._waiting: list[PrefilledBlocks] = []
        self._rid, self._attempt = order.request_id, order.attempt
        self.parts = 0  # posted so far (metrics, tests)

    def place(self, order: PrefillOrder) -> None:
        """The decode worker's blocks are known: post what was waiting for them."""
        with self._lock:
            self._order, waiting, self._waiting = order, self._waiting, []
            for blocks in waiting:
                self._forward(order, blocks)

    def __call__(self, blocks: PrefilledBlocks) -> None:
        try:
            if blocks.preempted:  # what was written is void: the hand-off fails, decode recomputes
                self._link.cancel(self._rid, self._attempt)
                return
            with self._lock:
                if self._order is None:
                    self._waiting.append(blocks)
                else:
                    self._forward(self._order, blocks)
        except Exception:  # the link closed under us (shutdown): the job's own end reports it
            log.exception("%s: could not stream a chunk's blocks", self._rid)

    def _forward(self, order: PrefillOrder, blocks: PrefilledBlocks) -> None:
        local, remote = self._pairs(order, blocks)
        if local:
            self._link.write_part(order.request_id, order.attempt, local, remote, blocks.ready)
            self.parts += 1

    def _pairs(self, order: PrefillOrder, blocks: PrefilledBlocks) -> tuple[tuple[int, ...], tuple[int, ...]]:
        remote_ids, skip = order.remote_block_ids, order.num_cached_tokens // self._block_size
        local, remote = [], []
        for offset, block_id in enumerate(blocks.block_ids):
            slot = blocks.first_index + offset - skip
            if 0 <= slot < len(remote_ids):
                local.append(block_id)
                remote.append(remote_ids[slot])
        return tuple(local), tuple(remote)
