"""CUDA graphs of the decode step, one per batch size of a ladder, over persistent input buffers.

A decode step of a Llama is ~10 kernels per layer: at small batches the GPU finishes each faster than
Python launches the next, so an eager step is launch-bound. Capturing the whole forward pass plus the
LM head once per batch size and replaying it removes that cost (gpt-fast, vLLM).

What a graph bakes in, and why each is safe to reuse:
- Tensor addresses: inputs live in `DecodeInputBuffers`; outputs (the logits) in the graphs' shared
  memory pool. Graphs share one pool, captured largest first, and only one replays at a time; its
  logits are read (sampled) before the next step replays any graph.
- Kernel launch parameters: the batch size (the padded size), and the split-KV count of the Triton
  decode, chosen at capture from `max_seq_len` (the model's context window): any split count is
  correct for any context length, so the graph stays correct as contexts grow.
- The weights and the KV cache tensor: owned by the model runner for its whole life.
Padded rows [B, P) are no-ops: slot -1 (the KV store skips it), context length 0 (the decode kernel
reads nothing and writes zeros), token 0 at position 0 (a valid embedding/RoPE row, never sampled).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.attention.base import AttentionMetadata
from engine.batch import ScheduledChunk
from engine.input_buffers import DecodeInputBuffers

log = logging.getLogger(__name__)

# (input_ids [P], positions [P], metadata of P rows) -> logits [P, vocab] float32
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(ladder: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """Ladder sizes worth capturing: those below `max_num_seqs`, plus the first one that holds it.

    Batches larger than every captured size run eagerly (no batch is ever padded past the ladder).
    """
    below = [s for s in ladder if s < max_num_seqs]
    above = [s for s in ladder if s >= max_num_seqs]
    return tuple(below + above[:1])


class DecodeGraphRunner:
    def __init__(self, forward: DecodeForward, buffers: DecodeInputBuffers, sizes: Sequence[int],
                 capture_max_seq_len: int, capture_error_mode: str = "global",
                 align: Callable[[], None] = lambda: None) -> None:
        """Under tensor parallelism: `capture_error_mode="thread_local"` (the process group's watchdog
        thread polls CUDA events during capture, which "global" mode would count as an error) and
        `align` = a barrier of the group, so every rank's device is idle and every rank is at the same
        graph when capture begins (a captured collective is only recorded, never run: a rank still
        running a warm-up collective would wait for a peer that is capturing)."""
        if not sizes or max(sizes) > buffers.max_batch:
            raise ValueError(f"capture sizes {tuple(sizes)} must be non-empty and <= {buffers.max_batch}")
        self._forward = forward
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self._capture_max_seq_len = capture_max_seq_len
        self._capture_error_mode = capture_error_mode
        self._align = align
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Decode-only (one token per sequence) and no larger than the largest captured size."""
        return 0 < len(chunks) <= self.max_batch and all(c.num_tokens == 1 for c in chunks)

    def padded_size(self, batch: int) -> int:
        """The smallest captured size that holds `batch` rows."""
        if not 0 < batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside 1..{self.max_batch}")
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    @torch.inference_mode()
    def release(self) -> None:
        """Destroy every captured graph (and with it the NCCL work captured inside it), then wait for
        the device: NCCL cannot tear a communicator down while a graph still holds its captured
        collectives (destroy and even abort then hang: pytorch#115388, seen on 2xH200)."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        torch.cuda.synchronize()

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its pool memory.

        Collective ops (tensor parallelism) run inside the warm-ups, so every rank must call this
        with the same sizes in the same order, which the shared config guarantees.
        """
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture_one(size, pool)
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %s) in %.1fs", len(self.sizes), self.sizes,
                 time.perf_counter() - start)

    def _capture_one(self, size: int, pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        b = self.buffers
        b.clear(size)
        meta = b.metadata(size, self._capture_max_seq_len)
        ids, pos = b.input_ids[:size], b.positions[:size]
        for _ in range(2):  # compiles the Triton kernels and creates cuBLAS / NCCL state outside the capture
            self._forward(ids, pos, meta)
        torch.cuda.synchronize()
        self._align()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=self._capture_error_mode):  # type: ignore[arg-type]
            logits = self._forward(ids, pos, meta)
        if logits.dim() != 2 or logits.shape[0] != size:
            raise RuntimeError(f"decode forward returned {tuple(logits.shape)}; expected [{size}, vocab]")
        return graph, logits

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Replay the step; return logits `[len(chunks), vocab]` (a view into the graph's output).

        The view is valid until the next `run`: read (sample) it before then.
        """
        size = self.padded_size(len(chunks))
        if size not in self._graphs:
            raise RuntimeError(f"no graph of batch {size}: call capture() first")
        graph, logits = self._graphs[size]
        self.buffers.load(chunks, size)
        graph.replay()
        return logits[: len(chunks)]

    def replay(self, batch: int) -> torch.Tensor:
        """Replay the graph of `batch`'s padded size on the inputs already in the buffers.

        For benchmarks: device time of the captured step without host staging. The inputs are
        whatever the last `run` loaded, so the step (and its KV writes) repeats exactly.
        """
        graph, logits = self._graphs[self.padded_size(batch)]
        graph.replay()
        return logits[:batch]
