"""One process per tensor-parallel (or pipeline stage, or expert) rank. Rank 0 lives in the caller's
process and drives the others; under pipeline parallelism it is stage 0's tensor rank 0.

`TensorParallelRunner` stands where a `ModelRunner` would (`execute`, `num_blocks`, `kv_spec`,
`kv_cache`, ...), so the engine above it (batcher, block manager, sampling) is unchanged:

    runner = create_model_runner(config, model_config, weights)   # ModelRunner when tp == 1
    result = runner.execute(plan)
    done = runner.pipeline_round(plan)   # pipeline_depth > 1: batches in flight across steps

Each `execute` broadcasts the plan (pickled plain dataclasses, over the gloo control group) to the
followers, then every rank runs the same step; the collectives inside the model keep them in step.
Followers are spawned (never forked: CUDA does not survive a fork), each load the model from
`config.model` themselves and keep their slice, so rank 0's `weights` must be that same model.

Rank services: a worker may give every follower a companion object (e.g. the NIXL agent of that
rank's KV shard), built in the follower's process by a picklable `rank_service(runner, tp)` factory
right after its ModelRunner. `call_followers(request)` runs `service.handle(request)` on every
follower and gathers the results to rank 0 (a follower's exception comes back as a `FollowerError`
and is raised on rank 0 after the gather, so the group stays in step).

Threads: the control group carries one sequence at a time. Rank 0 may be driven by two threads (the
engine thread's `execute`, a KV link thread's `call_followers`), so every broadcast together with the
collectives that follow it (the model's forward; the gather) runs under `_group_lock`. Deadlock-free
because a holder waits only on the followers, which serve calls strictly in broadcast order and never
wait on rank 0's other thread; a service's `handle` must end on its own (bounded), never wait for
the next broadcast. The messages are typed, one class per call (engine/parallel/commands.py).

Failure: a follower that dies leaves rank 0 blocked in a collective until `ParallelConfig.timeout_s`
passes, then torch.distributed raises on rank 0. Followers are daemonic: they die with rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.batch import BatchPlan, StepResult
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheSpec
from engine.model_runner import CompletedStep, ModelRunner
from engine.parallel.commands import (
    ExecuteStep,
    PipelineRound,
    RandomizeKVCache,
    RankService,
    ServiceRequest,
    run_collective,
)
from engine.parallel.group import (
    TensorParallel,
    check_parallel,
    init_tensor_parallel,
    open_rendezvous,
    shutdown_tensor_parallel,
)
from engine.sampler import Sampler

log = logging.getLogger(__name__)

# Builds a follower's companion object in its own process; must be picklable (spawn).
RankServiceFactory = Callable[[ModelRunner, TensorParallel], RankService]


@dataclass(frozen=True)
class FollowerError:
    """What a follower's rank-service call raised, gathered to rank 0 in place of a result."""

    rank: int
    message: str


class FollowerCallError(RuntimeError):
    """A rank-service call failed on at least one follower (every rank finished the call)."""

    def __init__(self, request: object, errors: list[FollowerError]) -> None:
        self.errors = errors
        details = "; ".join(f"rank {e.rank}: {e.message}" for e in errors)
        super().__init__(f"{type(request).__name__} failed on {len(errors)} follower(s): {details}")


def create_model_runner(config: EngineConfig, model_config: ModelConfig,
                        weights: Iterable[tuple[str, torch.Tensor]],
                        rank_service: RankServiceFactory | None = None) -> ModelRunner | TensorParallelRunner:
    """The runner for `config.parallel`: in-process for one rank, else rank 0 of a group (tensor,
    pipeline or expert parallel). `rank_service` is only used with followers (see the module docstring)."""
    if config.parallel.world_size == 1:
        return ModelRunner(config, model_config, weights)
    return TensorParallelRunner(config, model_config, weights, rank_service)


def _device_type(config: EngineConfig) -> str:
    return "cuda" if config.device.startswith("cuda") else "cpu"


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor]], rank_service: RankServiceFactory | None = None) -> None:
        parallel = config.parallel
        size = parallel.world_size
        # Fail before starting any process.
        check_parallel(model_config, parallel.tensor_parallel_size, parallel.expert_parallel_size,
                       parallel.pipeline_parallel_size)
        rendezvous = open_rendezvous(config.parallel)
        port = rendezvous.port
        ctx = mp.get_context("spawn")
        self._group_lock = threading.Lock()  # one broadcast + its collectives at a time (module docstring)
        self._followers = [ctx.Process(target=_follower_main, args=(config, rank, port, rank_service, os.getpid()),
                                       name=f"baton-tp{rank}", daemon=True) for rank in range(1, size)]
        for p in self._followers:
            p.start()
        try:
            self.tp: TensorParallel = init_tensor_parallel(config.parallel, 0, port, _device_type(config),
                                                              rendezvous)
            self.runner = ModelRunner(config, model_config, weights, self.tp)
            self.tp.barrier()  # every follower has its model, KV cache and graphs
        except BaseException:
            self._stop_followers(timeout=0.0)
            shutdown_tensor_parallel()
            raise
        self._closed = False
        log.info("worker group of %d ranks ready (tensor parallel %d, pipeline parallel %d, expert parallel %d)",
                 size, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.expert_parallel_size)

    # -- the ModelRunner surface the engine uses ---------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def sampler(self) -> Sampler:
        """Rank 0's sampler (the driver samples for every rank)."""
        return self.runner.sampler

    @property
    def kv_spec(self) -> KVCacheSpec:
        """Rank 0's shard (its KV heads; under pipeline parallelism stage 0's layers only)."""
        return self.runner.kv_spec

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's shard of the KV cache (its KV heads; under pipeline parallelism stage 0's layers)."""
        return self.runner.kv_cache

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def expert_load(self) -> torch.Tensor | None:
        """Rank 0's per-expert counts: every rank routes every token, so they are the whole group's."""
        return self.runner.expert_load()

    @property
    def pipeline_depth(self) -> int:
        """Batches the engine may keep in flight (ModelRunner.pipeline_depth)."""
        return self.runner.pipeline_depth

    def execute(self, plan: BatchPlan) -> StepResult:
        with self._group_lock:
            self.tp.broadcast_object(ExecuteStep(_slim(plan)))
            return self.runner.execute(plan)

    def pipeline_round(self, plan: BatchPlan) -> CompletedStep | None:
        """`ModelRunner.pipeline_round` on every rank. The whole round holds the group lock: a rank
        service's broadcast between the submit and the collect would meet a last stage blocked in
        sending the round's logits to rank 0."""
        with self._group_lock:
            self.tp.broadcast_object(PipelineRound(_slim(plan)))
            return self.runner.pipeline_round(plan)

    def randomize_kv_cache(self, seed: int) -> None:
        """`ModelRunner.randomize_kv_cache` on every rank (each fills its own shard)."""
        with self._group_lock:
            self.tp.broadcast_object(RandomizeKVCache(seed))
            self.runner.randomize_kv_cache(seed)

    def call_followers(self, request: object) -> list[object]:
        """`<rank service>.handle(request)` on every follower (from any thread of rank 0); returns
        their replies, rank 1 first. Raises FollowerCallError if any follower raised."""
        with self._group_lock:
            self.tp.broadcast_object(ServiceRequest(request))
            gathered: list[object] = [None] * self.tp.world_size
            dist.gather_object(None, gathered, dst=0, group=self.tp.cpu_group)
        results = gathered[1:]
        errors = [r for r in results if isinstance(r, FollowerError)]
        if errors:
            raise FollowerCallError(request, errors)
        return results

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the followers and leave the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            # A step stuck on a dead follower holds the lock: then stop the followers without a word.
            if self._group_lock.acquire(timeout=timeout):
                try:
                    self.tp.broadcast_object(None)
                finally:
                    self._group_lock.release()
        except Exception as e:  # noqa: BLE001 - a follower already gone: stop the others anyway
            log.warning("tensor parallel shutdown message failed (%s); stopping the followers", e)
        finally:
            self._stop_followers(timeout)
            self.runner.release_graphs()
            shutdown_tensor_parallel()

    def _stop_followers(self, timeout: float) -> None:
        for p in self._followers:
            p.join(timeout)
            if p.is_alive():
                log.warning("tensor parallel follower %s did not exit; terminating it", p.name)
                p.terminate()
                p.join(5.0)


def _slim(plan: BatchPlan) -> BatchPlan:
    """The plan as followers get it: they never sample, so the live token views (penalties, seeds) and
    a grammar constraint's parser state (which holds a lock: it does not pickle) stay on rank 0."""
    chunks = tuple(dataclasses.replace(c, prompt_token_ids=(), output_token_ids=(),
                                       sampling=dataclasses.replace(c.sampling, guided=None)
                                       if c.sampling.guided is not None else c.sampling)
                   for c in plan.chunks)
    return BatchPlan(chunks=chunks, preempted=plan.preempted, block_copies=plan.block_copies)


def _follower_main(config: EngineConfig, rank: int, port: int, rank_service: RankServiceFactory | None,
                   parent: int) -> None:
    """Rank > 0: load this rank's slice, then run every call rank 0 broadcasts until None."""
    from engine.loader import load_model  # heavy imports only in the child

    # Rank 0 stops us (its shutdown message, or its sockets closing when it dies): a Ctrl-C or a
    # SIGTERM sent to the whole process group must not kill a follower under a draining rank 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _exit_with_parent(parent)
    tp = init_tensor_parallel(config.parallel, rank, port, _device_type(config))
    service: RankService | None = None
    runner: ModelRunner | None = None
    try:
        loaded = load_model(config.model, config.load_format, config.dtype, tp.device, seed=config.seed,
                            cache_dir=config.cache_dir)
        runner = ModelRunner(config, loaded.model_config, loaded.weights, tp)
        service = rank_service(runner, tp) if rank_service is not None else None
        tp.barrier()
        while (call := tp.broadcast_object()) is not None:
            if isinstance(call, ServiceRequest):
                result = _call_service(service, call, rank)
                dist.gather_object(result, None, dst=0, group=tp.cpu_group)
            else:
                assert isinstance(call, ExecuteStep | PipelineRound | RandomizeKVCache), call
                run_collective(runner, call)
    finally:
        if service is not None:
            service.close()
        if runner is not None:
            runner.release_graphs()
        shutdown_tensor_parallel()


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """Exit at once when rank 0's process is gone. `daemon=True` only covers rank 0 exiting normally;
    a SIGKILLed rank 0 left followers holding their GPU memory (seen on 4xH200: the next worker on
    those GPUs ran out of memory), and a follower blocked in a collective or in NIXL teardown may
    never notice the closed sockets. `parent` is rank 0's pid as rank 0 passed it: read here, it would
    already be init's if rank 0 died while this process was still importing."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="baton-tp-parent-watch", daemon=True).start()


def _call_service(service: RankService | None, call: ServiceRequest, rank: int) -> object:
    """The request's reply, or a FollowerError: the gather must happen whatever the service does."""
    if service is None:
        return FollowerError(rank, "this follower has no rank service")
    try:
        return service.handle(call.request)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        log.exception("rank service request %s failed on rank %d", type(call.request).__name__, rank)
        return FollowerError(rank, f"{type(e).__name__}: {e}")
