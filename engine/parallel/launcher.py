"""One process per tensor-parallel rank. Rank 0 lives in the caller's process and drives the others.

`TensorParallelRunner` stands where a `ModelRunner` would (`execute`, `num_blocks`, `kv_spec`,
`kv_cache`, ...), so the engine above it (batcher, block manager, sampling) is unchanged:

    runner = create_model_runner(config, model_config, weights)   # ModelRunner when tp == 1
    result = runner.execute(plan)

Each `execute` broadcasts the plan (pickled plain dataclasses, over the gloo control group) to the
followers, then every rank runs the same step; the collectives inside the model keep them in step.
Followers are spawned (never forked: CUDA does not survive a fork), each load the model from
`config.model` themselves and keep their slice, so rank 0's `weights` must be that same model.

Failure: a follower that dies leaves rank 0 blocked in a collective until `ParallelConfig.timeout_s`
passes, then torch.distributed raises on rank 0. Followers are daemonic: they die with rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from engine.batch import BatchPlan, StepResult
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheSpec
from engine.model_runner import ModelRunner
from engine.parallel.group import (
    TensorParallel,
    check_tensor_parallel,
    free_port,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)

log = logging.getLogger(__name__)

# ModelRunner methods rank 0 may run on every rank. Each must make the same collective calls on
# every rank given the same arguments, or the group deadlocks.
COLLECTIVE_METHODS = frozenset({"execute", "randomize_kv_cache"})


@dataclass(frozen=True)
class RunnerCall:
    """A control message from rank 0: run `ModelRunner.<method>(*args)`; None means shut down."""

    method: str
    args: tuple[Any, ...]


def create_model_runner(config: EngineConfig, model_config: ModelConfig,
                        weights: Iterable[tuple[str, torch.Tensor]]) -> ModelRunner | TensorParallelRunner:
    """The runner for `config.parallel.tensor_parallel_size`: in-process for 1, else rank 0 of a group."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(config, model_config, weights)
    return TensorParallelRunner(config, model_config, weights)


def _device_type(config: EngineConfig) -> str:
    return "cuda" if config.device.startswith("cuda") else "cpu"


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        size = config.parallel.tensor_parallel_size
        check_tensor_parallel(model_config, size)  # fail before starting any process
        port = config.parallel.master_port or free_port(config.parallel.master_addr)
        ctx = mp.get_context("spawn")
        self._followers = [ctx.Process(target=_follower_main, args=(config, rank, port), name=f"baton-tp{rank}",
                                       daemon=True) for rank in range(1, size)]
        for p in self._followers:
            p.start()
        try:
            self.tp: TensorParallel = init_tensor_parallel(config.parallel, 0, port, _device_type(config))
            self.runner = ModelRunner(config, model_config, weights, self.tp)
            self.tp.barrier()  # every follower has its model, KV cache and graphs
        except BaseException:
            self._stop_followers(timeout=0.0)
            shutdown_tensor_parallel()
            raise
        self._closed = False
        log.info("tensor parallel group of %d ranks ready", size)

    # -- the ModelRunner surface the engine uses ---------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_spec(self) -> KVCacheSpec:
        return self.runner.kv_spec

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's shard of the KV cache (its KV heads)."""
        return self.runner.kv_cache

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def execute(self, plan: BatchPlan) -> StepResult:
        # Followers never sample, so the live token views (penalties, seeds) stay here.
        slim = BatchPlan(chunks=tuple(dataclasses.replace(c, prompt_token_ids=(), output_token_ids=())
                                      for c in plan.chunks), preempted=plan.preempted)
        self.tp.broadcast_object(RunnerCall("execute", (slim,)))
        return self.runner.execute(plan)

    def call(self, method: str, *args: Any) -> Any:
        """Run a collective-safe ModelRunner method on every rank; returns rank 0's result."""
        if method not in COLLECTIVE_METHODS:
            raise ValueError(f"{method!r} is not a collective runner method; valid: {sorted(COLLECTIVE_METHODS)}")
        self.tp.broadcast_object(RunnerCall(method, args))
        return getattr(self.runner, method)(*args)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the followers and leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.tp.broadcast_object(None)
        finally:
            self._stop_followers(timeout)
            shutdown_tensor_parallel()

    def _stop_followers(self, timeout: float) -> None:
        for p in self._followers:
            p.join(timeout)
            if p.is_alive():
                log.warning("tensor parallel follower %s did not exit; terminating it", p.name)
                p.terminate()
                p.join(5.0)


def _follower_main(config: EngineConfig, rank: int, port: int) -> None:
    """Rank > 0: load this rank's slice, then run every call rank 0 broadcasts until None."""
    from engine.loader import load_model  # heavy imports only in the child

    tp = init_tensor_parallel(config.parallel, rank, port, _device_type(config))
    try:
        loaded = load_model(config.model, config.load_format, config.dtype, tp.device, seed=config.seed,
                            cache_dir=config.cache_dir)
        runner = ModelRunner(config, loaded.model_config, loaded.weights, tp)
        tp.barrier()
        while (call := tp.broadcast_object()) is not None:
            assert isinstance(call, RunnerCall) and call.method in COLLECTIVE_METHODS, call
            getattr(runner, call.method)(*call.args)
    finally:
        shutdown_tensor_parallel()
