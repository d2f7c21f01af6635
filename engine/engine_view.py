"""The engine as a worker sees it: a small typed, read-only view instead of its runner and block manager.

A worker serves through the engine's public calls (add_request, step, abort, ...) and reads a few
things beside them: the KV pool's numbers it reports, the per-expert load it exports, and what the KV
transfer registers (rank 0's KV cache, its layout, and how to reach the follower ranks' shards). Those
reads go through `EngineView`, so the worker never reaches into `engine.runner` or
`engine.block_manager`, and a change there stays inside the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCacheSpec
from engine.model_runner import ModelRunner
from engine.parallel.launcher import TensorParallelRunner


@dataclass(frozen=True)
class KVPoolStatus:
    """The KV block pool's numbers, read between steps (on the engine thread, or before it starts)."""

    block_size: int  # tokens per block
    total_blocks: int
    free_blocks: int  # free now, cached prefix blocks included (reusable on demand)


@dataclass(frozen=True)
class KVExport:
    """What a KV transfer registers and reaches: rank 0's KV cache and layout, and the follower ranks."""

    kv_cache: torch.Tensor  # rank 0's shard
    kv_spec: KVCacheSpec  # rank 0's layout
    tp_size: int  # ranks over which the KV heads are sharded (1: the whole cache is here)
    pp_size: int  # pipeline stages over which the layers are split (1: every layer is here)
    # Runs a request on every follower rank's rank service and gathers the replies (None: one rank).
    call_followers: Callable[[object], list[object]] | None


class EngineView:
    def __init__(self, runner: ModelRunner | TensorParallelRunner, block_manager: BlockManager) -> None:
        self._runner = runner
        self._blocks = block_manager

    def kv_pool(self) -> KVPoolStatus:
        bm = self._blocks
        return KVPoolStatus(bm.block_size, bm.num_total_blocks, bm.num_free_blocks)

    def expert_load(self) -> torch.Tensor | None:
        """Per-expert token counts of the MoE layers, `[sparse layers, E]` (None: a dense model). Engine
        thread only: it reads device memory the next step writes."""
        return self._runner.expert_load()

    def kv_export(self) -> KVExport:
        runner = self._runner
        if isinstance(runner, TensorParallelRunner):
            return KVExport(runner.kv_cache, runner.kv_spec, runner.tp.size, runner.tp.pipeline.size,
                            runner.call_followers)
        return KVExport(runner.kv_cache, runner.kv_spec, 1, 1, None)

    @property
    def device(self) -> torch.device:
        return self._runner.kv_cache.device

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (reported for one rank only, as before)."""
        return isinstance(self._runner, ModelRunner) and self._runner.graphs is not None
