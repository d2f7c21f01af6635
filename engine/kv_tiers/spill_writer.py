"""`SpillWriter`: the disk tier's single I/O thread, as the engine thread sees it (writes and deletes).

A block goes to disk from a retired host slot (engine/kv_tiers/tier_lru.py). Its write is *deferred*
until the copy into that slot has been issued (the copies of a step are issued as one batch, later than
the bookkeeping decided the spill), because the I/O thread must first wait for that copy's event. Deletes
are deferred with the writes, so the thread runs every write, read and delete of a block in the order
the engine thread decided them. Finished writes are `reap`ed on the engine thread, which then releases
their slots.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.kv_tiers.disk_files import BlockFileError, DiskBlockFiles


@dataclass(frozen=True)
class FinishedSpill:
    block_hash: int
    slot: int  # the retired host slot it was written from: free to release now
    error: BlockFileError | None  # this hash's latest write failed (None: it succeeded, or a later one decides)


@dataclass(frozen=True)
class _Spill:
    block_hash: int
    slot: int
    write: Future[None]


class SpillWriter:
    """Not thread-safe: the engine thread calls it; the I/O thread only runs what it submits."""

    def __init__(self, files: DiskBlockFiles, host: torch.Tensor) -> None:
        self.files = files
        self.io = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")  # one thread: FIFO per block
        self._host = host  # the host tier's slots [num_slots, *block_shape]
        self._deferred: list[tuple[int, int | None]] = []  # (hash, slot): write; (hash, None): delete
        self._spills: list[_Spill] = []  # submitted writes, until reaped
        self._writes: dict[int, Future[None]] = {}  # hash -> its latest write (a read of it waits for it)

    def defer_write(self, block_hash: int, slot: int) -> None:
        self._deferred.append((block_hash, slot))

    def defer_delete(self, block_hash: int) -> None:
        self._deferred.append((block_hash, None))

    def submit(self, slot_ready: Callable[[int], torch.cuda.Event | None]) -> None:
        """Hand the deferred work to the I/O thread; `slot_ready(slot)`: the event of the copy filling it."""
        for block_hash, slot in self._deferred:
            if slot is None:
                self.io.submit(self.files.delete, block_hash)
                continue
            write = self.io.submit(self._write_slot, block_hash, slot, slot_ready(slot))
            self._writes[block_hash] = write
            self._spills.append(_Spill(block_hash, slot, write))
        self._deferred.clear()

    def latest_write(self, block_hash: int) -> Future[None] | None:
        return self._writes.get(block_hash)

    def _write_slot(self, block_hash: int, slot: int, ready: torch.cuda.Event | None) -> None:
        """I/O thread: write a host slot to disk once the copy into it has landed (checksummed here)."""
        if ready is not None:
            ready.synchronize()
        self.files.write(block_hash, self._host[slot])

    def reap(self) -> list[FinishedSpill]:
        """The writes finished since the last call."""
        finished: list[FinishedSpill] = []
        pending: list[_Spill] = []
        for spill in self._spills:
            if not spill.write.done():
                pending.append(spill)
                continue
            latest = self._writes.get(spill.block_hash) is spill.write
            if latest:
                del self._writes[spill.block_hash]
            error = spill.write.exception() if latest else None
            finished.append(FinishedSpill(spill.block_hash, spill.slot,
                                          error if isinstance(error, BlockFileError) else None))
        self._spills = pending
        return finished

    def barrier(self) -> None:
        """Return once everything submitted so far has run."""
        self.io.submit(lambda: None).result()

    def close(self) -> None:
        self.io.shutdown(wait=True, cancel_futures=True)
