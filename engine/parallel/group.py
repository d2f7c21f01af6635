"""One worker's tensor-parallel group: its rank, size, device, and the few collectives a Llama needs.

Under pipeline parallelism (`pipeline`, engine/parallel/pipeline.py) each stage's tensor ranks form a
group of their own (`group`); the control messages go to every process of the worker.

Under expert parallelism (`expert`, engine/parallel/expert.py) the worker's processes are the expert
ranks and the tensor-parallel size is 1: attention and dense layers are replicated, the control
messages below go to every process of the group (`world_rank`, `world_size`).

Passed explicitly to every layer that shards (no global "current group"), so a model built with
`TensorParallel()` (size 1) runs the exact single-GPU code path and touches torch.distributed never.

Collectives of the forward pass (`all_reduce`, `all_gather_last_dim`) go over the default process
group (NCCL on CUDA), in place or into fresh buffers, so they are CUDA-graph capturable once the
communicator exists (the warm-up before capture creates it). Control messages (`broadcast_object`)
go over `cpu_group`, a gloo group: pickled plans never pass through GPU memory, and a follower
waiting for the next plan blocks on a socket, not on the device.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig, ParallelConfig
from engine.errors import ConfigError
from engine.parallel.expert import ExpertParallel, all_gather_flat, check_expert_parallel
from engine.parallel.pipeline import PipelineParallel, check_pipeline_parallel


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cpu_group: Any = None  # gloo ProcessGroup for control messages; None: the default group (gloo on CPU)
    expert: ExpertParallel = field(default_factory=ExpertParallel)  # MoE experts' sharding
    pipeline: PipelineParallel = field(default_factory=PipelineParallel)  # this process's stage
    group: Any = None  # the tensor collectives' group (this stage's ranks); None: the default group
    # Under pipeline parallelism: rank 0 and the last stage's tensor rank 0, for the sampled logits.
    logits_group: Any = None

    @property
    def world_rank(self) -> int:
        """This process's rank in the worker's group (tensor ranks within expert ranks or stages)."""
        return (self.pipeline.rank + self.expert.rank) * self.size + self.rank

    @property
    def world_size(self) -> int:
        return self.size * self.expert.size * self.pipeline.size

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the batcher and the sampler; the others only run the model."""
        return self.world_rank == 0

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """`(start, size)` of this rank's even share of `total` rows; `total` must divide evenly."""
        if total % self.size:
            raise ConfigError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.size})")
        size = total // self.size
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (the row-parallel layers' partial products)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., n]` per rank -> `[..., size * n]`, rank r's columns at `r * n` (vocab-parallel logits)."""
        if self.size == 1:
            return x
        # The concatenated form ([size * rows, n]): gloo rejects the stacked one.
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty((self.size * flat.shape[0], flat.shape[1]), dtype=x.dtype, device=x.device)
        all_gather_flat(out, flat, group=self.group)
        gathered = out.view(self.size, flat.shape[0], flat.shape[1]).transpose(0, 1)  # [rows, size, n]
        return gathered.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled, over the gloo control group)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


def open_rendezvous(config: ParallelConfig) -> dist.TCPStore:
    """The group's meeting point, bound before any rank starts: its port (`.port`) goes to the ranks.

    With no `master_port` the store binds port 0 and the OS picks, so nothing can take the port between
    the pick and the bind (a port picked free and bound later was lost to another process in CI).
    The process that opens it must keep it until the group is formed; rank 0 passes it as `store`.
    """
    return dist.TCPStore(config.master_addr, config.master_port or 0, config.world_size, is_master=True,
                         timeout=timedelta(seconds=config.timeout_s), wait_for_workers=False)


def init_tensor_parallel(config: ParallelConfig, rank: int, port: int, device_type: str,
                         store: dist.Store | None = None) -> TensorParallel:
    """Join the group as `rank` (blocks until every rank has joined); rank r takes cuda:r on CUDA.

    The ranks meet at the store `open_rendezvous` opened on `port`; its opener passes it as `store`.
    """
    size = config.world_size
    backend = config.distributed_backend or ("nccl" if device_type == "cuda" else "gloo")
    device = torch.device("cpu")
    if device_type == "cuda":
        if torch.cuda.device_count() < size:
            raise ConfigError(f"a worker group of {size} ranks needs {size} GPUs, found {torch.cuda.device_count()}")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if not config.allow_nvls:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # read by NCCL when the communicator is created
    timeout = timedelta(seconds=config.timeout_s)
    if store is None:
        store = dist.TCPStore(config.master_addr, port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    # One of tp and ep is 1 (ParallelConfig), so both kinds of collective use the default group, unless
    # stages split it: then each stage's tensor ranks get a group of their own.
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    ep_size = config.expert_parallel_size
    expert = ExpertParallel(rank=rank // tp_size if ep_size > 1 else 0, size=ep_size)
    stage = rank // tp_size if pp_size > 1 else 0
    pipeline = PipelineParallel(rank=stage, size=pp_size, tp_rank=rank % tp_size, tp_size=tp_size)
    group = _stage_group(pipeline, timeout) if pp_size > 1 and tp_size > 1 else None
    logits_group = _logits_group(pipeline, timeout) if pp_size > 1 else None
    return TensorParallel(rank=rank % tp_size, size=tp_size, device=device, cpu_group=cpu_group, expert=expert,
                          pipeline=pipeline, group=group, logits_group=logits_group)


def _stage_group(pipeline: PipelineParallel, timeout: timedelta) -> Any:
    """This stage's tensor ranks as a group; every rank must create every stage's group, in order."""
    groups = [dist.new_group(list(range(s * pipeline.tp_size, (s + 1) * pipeline.tp_size)), timeout=timeout)
              for s in range(pipeline.size)]
    return groups[pipeline.rank]


def _logits_group(pipeline: PipelineParallel, timeout: timedelta) -> Any:
    """Rank 0 and the last stage's tensor rank 0; every rank must create it. The logits travel apart
    from the activations because with batches in flight (pipeline_rounds.py) the last stage sends a
    batch's logits before it receives the next batch's activations, which rank 0 sent before it
    receives those logits: over one in-order NCCL stream per pair of ranks (2 stages) that is a cycle."""
    group = dist.new_group([0, (pipeline.size - 1) * pipeline.tp_size], timeout=timeout)
    is_member = pipeline.rank == 0 and pipeline.tp_rank == 0 or pipeline.sends_logits
    return group if is_member else None


# Set once this process captured NCCL collectives into CUDA graphs (ModelRunner does under TP).
_captured_collectives = False


def mark_collectives_captured() -> None:
    global _captured_collectives
    _captured_collectives = True


def shutdown_tensor_parallel() -> None:
    """Leave the group. After NCCL collectives were captured into CUDA graphs, `destroy_process_group`
    hangs in ncclCommDestroy (pytorch#115388; seen on 2xH200, torch 2.11), so such a process aborts its
    communicators instead: nothing is in flight at shutdown, and abort also clears torch's group state."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if _captured_collectives and abort is not None:
        abort()
    else:
        dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS's pick); rank 0 chooses it before the others start."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: an even share, or one replicated head when there are fewer than ranks."""
    return max(1, num_kv_heads // tp_size)


def kv_head_start(num_kv_heads: int, tp: TensorParallel) -> int:
    """First KV head of this rank. With fewer KV heads than ranks, ranks r * kv / tp share one head:
    exactly the KV head of the query heads rank r holds (query head h reads KV head h // (H / kv))."""
    return tp.rank * num_kv_heads // tp.size


def check_parallel(config: ModelConfig, tp_size: int, ep_size: int, pp_size: int = 1) -> None:
    """Reject a model that cannot be sharded `tp_size` ways, its experts `ep_size` ways or its layers
    over `pp_size` stages."""
    check_tensor_parallel(config, tp_size)
    check_pipeline_parallel(config.num_layers, pp_size)
    check_expert_parallel(config.moe.num_experts if config.moe is not None else None, ep_size)


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Reject a model that cannot be sharded `tp_size` ways, naming the dimension and the valid sizes."""
    if tp_size == 1:
        return
    dims = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size}
    if config.moe is not None:  # every expert (and the shared expert) is sharded like a dense MLP
        dims["moe_intermediate_size"] = config.moe.intermediate_size
        if config.moe.has_shared_expert:
            dims["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    for name, value in dims.items():
        if value % tp_size:
            raise ConfigError(f"{name} ({value}) is not divisible by tensor_parallel_size ({tp_size})")
    kv = config.num_kv_heads
    if config.mla is None and kv % tp_size and tp_size % kv:  # latent attention: one latent, every rank
        valid = sorted({d for d in range(1, config.num_heads + 1) if all(v % d == 0 for v in dims.values())
                        and (kv % d == 0 or d % kv == 0)})
        raise ConfigError(f"num_kv_heads ({kv}) must divide or be divisible by tensor_parallel_size ({tp_size}); "
                          f"valid sizes for this model: {valid}")
