"""Frozen configuration of a worker process, validated at creation (built from flags in main only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtransfer.faults import FaultConfig
from kvtransfer.transport import TransportKind

# A worker's role, as the scheduler names it: prefill serves Prefill (computes prompts and WRITEs their KV
# into decode workers); decode serves Generate (prefilling remotely or, conditionally, locally); both is
# classic co-located serving with chunked prefill (the baseline; no NIXL).
from scheduler.types import WorkerRole as WorkerRole
from services.common.cluster_auth import ClusterToken


@dataclass(frozen=True)
class DisaggPolicy:
    """Conditional disaggregation: when a decode worker prefills a prompt itself.

    A remote prefill costs a round trip plus a transfer; for a short prompt, or one mostly served
    by the decode worker's own prefix cache, recomputing locally is cheaper.
    """

    min_remote_prompt_tokens: int = 64  # shorter prompts prefill locally
    min_remote_uncached_tokens: int = 32  # fewer uncached tokens (after the prefix cache) prefill locally
    max_cached_fraction: float = 0.8  # a prompt at least this cached prefills locally

    def __post_init__(self) -> None:
        if self.min_remote_prompt_tokens < 1 or self.min_remote_uncached_tokens < 1:
            raise ValueError("min_remote_prompt_tokens and min_remote_uncached_tokens must be >= 1")
        if not 0.0 < self.max_cached_fraction <= 1.0:
            raise ValueError(f"max_cached_fraction must be in (0, 1], got {self.max_cached_fraction}")

    def remote_by_length(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens >= self.min_remote_prompt_tokens

    def remote_given_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> bool:
        uncached = num_prompt_tokens - num_cached_tokens
        if uncached < self.min_remote_uncached_tokens:
            return False
        return num_cached_tokens / num_prompt_tokens < self.max_cached_fraction


@dataclass(frozen=True)
class TransferConfig:
    """Deadlines and safety of the KV hand-off. The decode side's quarantine must outlast the
    prefill side's transfer deadline: a WRITE may land until then."""

    prefill_timeout_s: float = 60.0  # decode -> prefill RPC deadline (queue + prefill + WRITE)
    transfer_timeout_s: float = 10.0  # one WRITE's deadline on the prefill worker
    notice_grace_s: float = 2.0  # decode: wait this long for the NIXL notice after a DONE response
    quarantine_s: float = 30.0  # decode: blocks of an attempt with no definite end stay unusable
    checksums: bool = True  # prefill engine checksums the blocks into the notice; decode engine verifies
    poll_busy_s: float = 5e-5  # link thread sleep while a WRITE is in flight
    poll_expect_s: float = 2e-4  # ... while an arrival is expected
    # ... with nothing in flight or expected: a command wakes the thread at once, so this tick only
    # flushes outgoing abort notices and reaps expired quarantines. At 1 ms its polls took the GIL
    # from the prefill engine thread a thousand times a prefill (lab/notes, 2026-12-02 idle hand-off).
    poll_quiet_s: float = 1e-2
    poll_idle_s: float = 1e-3  # follower ranks' agents between WRITEs (passive targets: kvtransfer/nixl/shards.py)
    peer_down_s: float = 5.0  # a prefill worker that failed at the transport is skipped this long
    # NIXL's own progress thread: UCX then advances WRITEs and delivers notices without the KV link
    # thread, which needs the GIL for every poll (measured under load on 2xH100: WRITE posted -> done
    # 102 ms without it, 4.3 ms with it). None = on where the KV cache is on a GPU; off on CPU, where
    # each agent's thread would busy-poll about half a core.
    progress_thread: bool | None = None
    nixl_threads: int = 0  # UCX worker threads per agent (0: NIXL's default)
    # What moves the blocks (kvtransfer/transport.py): NIXL, or the in-process fake of the unit tests.
    transport: TransportKind = TransportKind.NIXL
    # Prefill side: write each chunk's full blocks while the next chunk computes (kvtransfer KVStream),
    # for prompts of at least `stream_min_prompt_tokens` (shorter ones fit one or two chunks, where the
    # extra WRITEs cost more than they overlap: SGLang measured +18% TTFT below 256 tokens). The
    # default is a guess until the crossover is measured: lab/micro/bench_disagg_gpu.py
    # --stream-sweep gives TTFT streamed vs not per prompt length; set it where streaming starts to win.
    stream_kv: bool = True
    stream_min_prompt_tokens: int = 1024
    # Decode side: send the Prefill RPC before reserving the blocks (the reservation waits for the
    # engine's next step boundary) and send the blocks in a PrefillDestination call once reserved, so
    # the prefill computes during the reservation. A prompt the decode worker's prefix cache then
    # mostly serves withdraws it (Abort): wasted prefill work, never a wrong block.
    overlap_reserve: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "transport", TransportKind.parse(self.transport))
        for name in ("prefill_timeout_s", "transfer_timeout_s", "notice_grace_s", "quarantine_s",
                     "poll_busy_s", "poll_expect_s", "poll_quiet_s", "poll_idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.stream_min_prompt_tokens < 1:
            raise ValueError(f"stream_min_prompt_tokens must be >= 1, got {self.stream_min_prompt_tokens}")
        if self.quarantine_s <= self.transfer_timeout_s:
            raise ValueError(
                f"quarantine_s ({self.quarantine_s}) must exceed transfer_timeout_s ({self.transfer_timeout_s}): "
                "a WRITE may land until its deadline"
            )

    def streams(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt this long has its KV streamed per chunk."""
        return self.stream_kv and num_prompt_tokens >= self.stream_min_prompt_tokens

    @property
    def hold_lease_s(self) -> float:
        """Prefill side: how long held blocks may wait for their WRITE (start + deadline + cancel)."""
        return self.transfer_timeout_s + 30.0


@dataclass(frozen=True)
class WorkerConfig:
    role: WorkerRole
    model_id: str  # what the handshake compares (the served model name)
    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str = ""  # host:port peers and the scheduler use; default host:port
    worker_id: str = ""
    scheduler_address: str = ""  # empty: no registration
    metrics_port: int | None = None
    prefill_peers: tuple[str, ...] = ()  # decode role: prefill workers' host:port
    heartbeat_interval_s: float = 1.0
    drain_grace_s: float = 20.0  # SIGTERM: finish in-flight work this long, then abort the rest
    # The engine's ranks (one process and GPU each). Equal prefill/decode sizes: rank r hands its KV shard
    # to the peer's rank r; a single-rank prefill feeds any decode size by head slices (kvtransfer/heads.py).
    tensor_parallel_size: int = 1
    # MoE experts sharded over this many ranks (attention replicated, so every rank holds the whole
    # KV cache): co-located workers only, KV hand-off to every replica is not implemented.
    expert_parallel_size: int = 1
    # Layers split over this many stages (engine/parallel/pipeline.py). A prefill worker's stages each
    # WRITE their own layers into the decode rank holding them (kvtransfer/stages.py: same split, or
    # merged into fewer decode stages).
    pipeline_parallel_size: int = 1
    allow_fault_injection: bool = False
    faults: FaultConfig = field(default_factory=FaultConfig)
    policy: DisaggPolicy = field(default_factory=DisaggPolicy)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # Asked of every caller of this worker's port, and sent to the scheduler and prefill peers
    # (services/common/cluster_auth.py); None: the port is open and calls go out without it.
    cluster_token: ClusterToken | None = None

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id is empty")
        if self.role is not WorkerRole.DECODE and self.prefill_peers:
            raise ValueError(f"--prefill-peers is for decode workers; this one is {self.role.value}")
        if self.heartbeat_interval_s <= 0 or self.drain_grace_s < 0:
            raise ValueError("heartbeat_interval_s must be > 0 and drain_grace_s >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.expert_parallel_size > 1 and self.uses_nixl:
            raise ValueError(f"--expert-parallel-size needs --role both (this worker is {self.role.value}): "
                             "every expert-parallel rank holds a full KV cache, and handing KV off to each "
                             "replica is not implemented")

    @property
    def uses_nixl(self) -> bool:
        return self.role is not WorkerRole.BOTH
