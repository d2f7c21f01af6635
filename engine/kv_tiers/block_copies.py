"""`BlockCopies`: the copies between the GPU pool and the host tier's slots, batched, on side streams.

Down (GPU block -> host slot: a demotion) copies are queued by the engine thread and issued as one batch
(`issue`): one `_foreach_copy_` call over block views made once at start-up (no per-block Python work,
no index tensor, so no pageable host-to-device copy), one event for the whole batch, on the `down`
stream after the engine's stream (which wrote the KV). Up (host slot -> GPU block: a promotion) copies run
on their own `up` stream, so a load never queues behind demotions that do not concern it: it waits only
for the unfinished events of the copies that write its source slots or still read its destination blocks.
PCIe is full duplex, so the two directions overlap.

Nothing here waits on the host: the engine's stream is made to wait (`guard_overwrite`) only for an
unfinished copy still reading a block the engine is about to overwrite. On the CPU backend the pool is
host memory: copies are synchronous memcpys at `issue` / `copy_up`.
"""

from __future__ import annotations

import torch


class BlockCopies:
    """Not thread-safe (the engine thread), except `slot_ready`'s events, which any thread may wait on."""

    def __init__(self, kv_cache: torch.Tensor, host: torch.Tensor) -> None:
        self._gpu_blocks = kv_cache.unbind(0)  # views of every block, made once
        self._host_slots = host.unbind(0)
        self._device = kv_cache.device
        self._cuda = kv_cache.is_cuda
        self._down = torch.cuda.Stream(self._device) if self._cuda else None
        self._up = torch.cuda.Stream(self._device) if self._cuda else None
        self._queued: dict[int, int] = {}  # host slot -> GPU block, not yet issued (insertion order)
        self._queued_blocks: set[int] = set()
        self._slot_written: dict[int, torch.cuda.Event] = {}  # host slot -> the issued copy writing it
        self._block_read: dict[int, torch.cuda.Event] = {}  # GPU block -> the issued copy reading it

    def queue_down(self, block_id: int, slot: int) -> None:
        self._queued[slot] = block_id
        self._queued_blocks.add(block_id)

    def is_queued(self, block_id: int) -> bool:
        return block_id in self._queued_blocks

    def issue(self) -> list[int]:
        """Issue every queued down copy as one batch; returns their slots (whose events are now known)."""
        if not self._queued:
            return []
        slots, blocks = list(self._queued), list(self._queued.values())
        self._queued.clear()
        self._queued_blocks.clear()
        dst = [self._host_slots[s] for s in slots]
        src = [self._gpu_blocks[b] for b in blocks]
        if self._down is None:
            torch._foreach_copy_(dst, src)
            return slots
        self._down.wait_stream(torch.cuda.current_stream(self._device))  # the KV was written there
        with torch.cuda.stream(self._down):
            torch._foreach_copy_(dst, src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._down)
        for s in slots:
            self._slot_written[s] = done
        for b in blocks:
            self._block_read[b] = done
        return slots

    def slot_ready(self, slot: int) -> torch.cuda.Event | None:
        """The event after which host slot `slot` holds its bytes (None: it already does). Issued only."""
        assert slot not in self._queued, "issue() the slot's copy first"
        return self._slot_written.get(slot)

    def reading(self, block_id: int) -> torch.cuda.Event | None:
        """The issued copy that may still read GPU block `block_id` (None: none), for a writer on another
        stream or thread to wait for."""
        return self._block_read.get(block_id)

    def guard_overwrite(self, block_id: int) -> None:
        """The engine's stream is about to write new content into `block_id`: order it after any copy
        still reading the block (issuing it first if it was only queued)."""
        if block_id in self._queued_blocks:
            self.issue()
        done = self._block_read.get(block_id)
        if done is None:
            return
        if done.query():
            del self._block_read[block_id]
            return
        torch.cuda.current_stream(self._device).wait_event(done)

    def copy_up(self, pairs: list[tuple[int, int]]) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """Copy host slots into GPU blocks, [(slot, block_id)], on the up stream. Returns timing events
        (start, done) on CUDA; on CPU the copies have happened when it returns (None). The caller issues
        queued down copies first where they touch these slots or blocks."""
        dst = [self._gpu_blocks[b] for _, b in pairs]
        src = [self._host_slots[s] for s, _ in pairs]
        if self._up is None:
            torch._foreach_copy_(dst, src)
            return None
        waits = {id(e): e for e in [*(self._slot_written.get(s) for s, _ in pairs),
                                    *(self._block_read.get(b) for _, b in pairs)] if e is not None}
        self._up.wait_stream(torch.cuda.current_stream(self._device))  # the blocks' last use by the engine
        for event in waits.values():
            if not event.query():
                self._up.wait_event(event)
        with torch.cuda.stream(self._up):
            started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record(self._up)
            torch._foreach_copy_(dst, src, non_blocking=True)
            done.record(self._up)
        return started, done

    def touches(self, pairs: list[tuple[int, int]]) -> bool:
        """Whether a queued down copy writes one of these slots or reads one of these blocks."""
        return any(s in self._queued or b in self._queued_blocks for s, b in pairs)
