"""Persistent device input buffers of CUDA-graph decode steps, and their pinned host staging.

A captured graph reads fixed addresses, so every decode step writes its inputs into the same device
tensors, sized for the largest captured batch:

    input_ids     [max_batch] int64
    positions     [max_batch] int64
    slot_mapping  [max_batch] int64   -1 on padded rows: the KV store skips negative slots
    seq_lens      [max_batch] int32    0 on padded rows: decode reads no context for them
    block_tables  [max_batch, max_blocks] int32
    query_start_loc [max_batch + 1] int32   arange: one query token per row, fixed at creation

A step of B sequences padded to a captured size P >= B fills rows [0, B) from the chunks and rows
[B, P) as padding, in host staging (pinned on CUDA), then queues two non-blocking copies, one per
dtype: ids, positions and slots live in one int64 area, context lengths and the table block in one
int32 area (the tensors above are views into them). Only the block-table columns the step needs are
copied (a `[P, width]` block through a contiguous scratch buffer, then a device-side copy): columns
past `width` keep stale ids, which no kernel reads, since a row reads at most `ceil(seq_len /
block_size) <= width` table entries.

Staging reuse: the host rows are rewritten at the next step while the previous step's copies may in
principle still be queued. `load` therefore waits on the event recorded after the last copies
first. In the engine that wait is free (every step ends by reading sampled tokens, which waits for
the whole step); it exists so that a caller who does not sync (a TP follower) stays correct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import AttentionMetadata
from engine.batch import ScheduledChunk


class DecodeInputBuffers:
    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        if max_batch <= 0 or max_blocks <= 0:
            raise ValueError(f"max_batch and max_blocks must be positive, got {max_batch}, {max_blocks}")
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.device = device
        on_cuda = device.type == "cuda"

        def both(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
            return host, torch.zeros(shape, dtype=dtype, device=device)

        # Two staging areas of one dtype each, so a step is two host->device copies, not five: each
        # copy is a driver call costing tens of us of host time on a GPU host, whatever its size.
        self._host_wide, self._wide = both((3, max_batch), torch.int64)  # ids, positions, slots
        self._host_ids, self._host_pos, self._host_slots = self._host_wide.unbind()
        self.input_ids, self.positions, self.slot_mapping = self._wide.unbind()
        narrow = [max_batch, max_batch * max_blocks]  # context lengths, then the step's table block
        self._host_narrow, self._narrow = both((sum(narrow),), torch.int32)
        self._host_lens, self._host_tables = self._host_narrow.split(narrow)
        self.seq_lens, self._table_scratch = self._narrow.split(narrow)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._host_slots.fill_(-1)
        self.slot_mapping.fill_(-1)
        self._copied = torch.cuda.Event() if on_cuda else None

    def load(self, chunks: Sequence[ScheduledChunk], padded: int) -> None:
        """Write a decode step of `len(chunks)` sequences into rows [0, padded); the rest is padding."""
        width = self._check(chunks, padded)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging rows
        self._stage(chunks, padded, width)
        self._upload(padded, width)

    def clear(self, padded: int) -> None:
        """Make rows [0, padded) padding (graph capture runs on these: every row a no-op)."""
        self.load((), padded)

    def metadata(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        """Views of the first `batch` rows. `max_seq_len` is only the capture-time hint of split-KV.

        The host tuples describe the capture, not a step: a replay never reads them.
        """
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=(1,) * batch,
            seq_lens_cpu=(max_seq_len,) * batch,
        )

    def _check(self, chunks: Sequence[ScheduledChunk], padded: int) -> int:
        """Validate the step; return the block-table width it needs (at least 1)."""
        if not len(chunks) <= padded <= self.max_batch:
            raise ValueError(f"need len(chunks)={len(chunks)} <= padded={padded} <= max_batch={self.max_batch}")
        width = 1
        for c in chunks:
            if c.num_tokens != 1:
                raise ValueError(f"{c.request_id}: a graph decode step takes 1 token per sequence, got {c.num_tokens}")
            need = -(-c.context_len // self.block_size)
            if need > len(c.block_ids):
                raise ValueError(f"{c.request_id}: {len(c.block_ids)} blocks cannot hold {c.context_len} tokens")
            width = max(width, need)
        if width > self.max_blocks:
            raise ValueError(f"a context needs {width} blocks; the buffers hold {self.max_blocks} per sequence")
        return width

    def _stage(self, chunks: Sequence[ScheduledChunk], padded: int, width: int) -> None:
        """Fill host rows [0, padded) through numpy views (no per-element torch calls)."""
        bs, n = self.block_size, len(chunks)
        ids, pos, slots = self._host_ids.numpy(), self._host_pos.numpy(), self._host_slots.numpy()
        lens = self._host_lens.numpy()
        tables = self._host_tables.numpy()[: padded * width].reshape(padded, width)
        tables[:] = 0
        for i, c in enumerate(chunks):
            p = c.start_pos
            ids[i], pos[i], lens[i] = c.token_ids[0], p, c.context_len
            slots[i] = c.block_ids[p // bs] * bs + p % bs
            used = -(-c.context_len // bs)
            tables[i, :used] = c.block_ids[:used]
        ids[n:padded], pos[n:padded], lens[n:padded], slots[n:padded] = 0, 0, 0, -1

    def _upload(self, padded: int, width: int) -> None:
        # Every row of the 64-bit area (at most a few KB): rows past `padded` carry stale values that
        # no graph of this size reads, and one contiguous copy beats a strided one.
        self._wide.copy_(self._host_wide, non_blocking=True)
        count = self.max_batch + padded * width  # all context lengths, then the table block
        self._narrow[:count].copy_(self._host_narrow[:count], non_blocking=True)
        scratch = self._table_scratch[: padded * width]
        self.block_tables[:padded, :width].copy_(scratch.view(padded, width))  # device-side, strided
        if self._copied is not None:
            self._copied.record()
