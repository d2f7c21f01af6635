"""The one way to open a KV transport: `open_transport(kind, ...)` -> `Transport` (sender + receiver).

A worker's KV link asks for a transport by name and from then on sees only the `KVSender` /
`KVReceiver` contract (kvtransfer/base.py); which byte mover sits underneath is this module's
business. Heavy imports stay inside the factory: opening a memory transport never imports NIXL.

    nixl    NIXL agent over the registered KV tensor (UCX: DRAM on CPU, VRAM on CUDA); production
    memory  in-process fake for tests: blocks are copied between tensors of one process, peers are
            found by agent name on `kvtransfer.memory.FABRIC` (kvtransfer/memory/agent.py)

Both kinds run the same sender/receiver state machines (deadlines, cancel, ABORTED notices,
quarantine, fault injection), so a test on `memory` holds for `nixl` wherever bytes are not the point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

import torch

from kvtransfer.base import HandshakeInfo
from kvtransfer.faults import FaultInjector
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.roles import KVReceiver, KVSender
from kvtransfer.shards import KVShards


class TransportKind(StrEnum):
    NIXL = "nixl"
    MEMORY = "memory"

    @classmethod
    def parse(cls, value: str | TransportKind) -> TransportKind:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown KV transport {value!r}; valid: {', '.join(k.value for k in cls)}") from None


class Transport:
    """An open transport: this worker's KV sender and receiver over one agent (one registered KV
    tensor). Not thread-safe, like the sender and receiver: one thread makes every call, `close()`
    included (the KV link's thread, or a test's). Close it once no peer may still write."""

    def __init__(self, kind: TransportKind, sender: KVSender, receiver: KVReceiver,
                 close_agent: Callable[[], None]) -> None:
        self.kind = kind
        self.sender = sender
        self.receiver = receiver
        self._close_agent = close_agent
        self._closed = False

    @property
    def handshake_info(self) -> HandshakeInfo:
        """What peers are told about this worker (every rank's agent under tensor parallelism)."""
        return self.sender.handshake_info

    def close(self) -> None:
        """Cancel in-flight WRITEs (bounded wait for the agent to let go), stop tracking arrivals,
        then release the agent and its registration. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.sender.close()
        self.receiver.close()
        self._close_agent()


def open_transport(kind: TransportKind | str, name: str, kv_cache: torch.Tensor, layout: KVLayoutInfo, *,
                   progress_thread: bool | None = None, num_threads: int = 0, faults: FaultInjector | None = None,
                   shards: KVShards | None = None, quarantine_s: float = 30.0,
                   clock: Callable[[], float] = time.monotonic) -> Transport:
    """Open `kind` over the whole KV pool `kv_cache` (block-major, as `layout` describes it).

    `name`: the agent's name, unique per process and role (peers address it by name).
    `progress_thread`: NIXL's own progress thread; None = on when the KV cache is on a GPU.
    `num_threads`: NIXL/UCX worker threads (0: NIXL's default). Both are ignored by `memory`.
    `faults`: consulted by the sender and receiver at their injection points (kvtransfer/faults.py).
    `shards`: the follower ranks of a tensor-parallel worker (this transport is rank 0's).
    `quarantine_s`: how long released blocks without a definite end of their WRITE stay unusable.
    `clock`: the monotonic clock deadlines and quarantines are measured on (tests pass a manual one).
    Raises ValueError for an unknown kind (naming the valid ones), NixlUnavailableError when `nixl`
    cannot be imported, ValueError when `kv_cache` is not the pool `layout` describes.
    """
    from kvtransfer.nixl import NixlAgentConfig, NixlKVReceiver, NixlKVSender, ReceiverConfig

    kind = TransportKind.parse(kind)
    progress = progress_thread if progress_thread is not None else kv_cache.is_cuda
    config = NixlAgentConfig(name=name, progress_thread=progress, num_threads=num_threads)
    if kind is TransportKind.NIXL:
        from kvtransfer.nixl import NixlAgent

        agent: NixlAgent = NixlAgent(config, kv_cache, layout)
    else:
        from kvtransfer.memory import FABRIC, MemoryAgent

        agent = MemoryAgent(config, kv_cache, layout, FABRIC)
    faults = faults or FaultInjector()
    try:
        sender = NixlKVSender(agent, faults=faults, clock=clock, shards=shards)
        receiver = NixlKVReceiver(agent, ReceiverConfig(quarantine_s=quarantine_s), faults, clock, shards=shards)
    except Exception:
        agent.close()
        raise
    return Transport(kind, sender, receiver, agent.close)
