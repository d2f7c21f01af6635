"""KV transfer across a tensor-parallel worker's ranks: one NIXL agent per rank, each over its own KV shard.

Rank r of a prefill worker writes its shard of a request's blocks into rank r of the decode worker
(homogeneous TP: both have tp_size ranks and shard KV heads the same way). Rank 0's KV link owns
the sender/receiver and the one notification per request; the follower ranks are reached through
the engine's tensor-parallel control group (`TensorParallelRunner.call_followers`):

- `ShardAgentFactory` is handed to the engine, which builds a `ShardAgent` in every follower process
  right after its model runner (its KV cache exists by then): the follower's NIXL agent, registered
  over its KV shard, driven by a polling thread of its own.
- `FollowerShards` is rank 0's `KVShards`: each method is one broadcast + gather over the control
  group, serialised with the engine's steps by the runner's group lock (a WRITE therefore holds the
  next engine step back until every follower's WRITE is terminal).

Passive targets: with NIXL's progress thread off, a decode follower's agent must keep progressing
(UCX wire-up, the peer's WRITE) although nothing on that rank ever waits for a transfer; its
`ShardAgent` thread polls every `poll_idle_s` for the process's whole life, and drops the
notifications it drains (none are expected: followers never notify).
Clocks: a plan's deadline is on rank 0's monotonic clock; the ranks of a worker share one host, and
CLOCK_MONOTONIC is system-wide on Linux.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.base import HandshakeInfo, KVLayoutInfo, TransferPlan, TransferState
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.integrity import block_checksums
from kvtransfer.nixl import NixlAgent, NixlAgentConfig
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.shards import KVShards, ShardOutcome

log = logging.getLogger(__name__)
_RELEASE_GRACE_S = 5.0  # past the deadline, how long a follower waits for NIXL to let go of its WRITE
_SETUP_TIMEOUT_S = 30.0  # add_peer on the agent thread (connection wire-up is non-blocking)


@dataclass(frozen=True)
class ShardWrite:
    """Rank 0's order to every follower: WRITE your shard of `plan` into the peer's same rank."""

    peer: str  # the peer worker's rank 0 agent (each follower maps it to the peer's agent of its rank)
    plan: TransferPlan
    checksums: bool
    fail_rank: int | None = None  # fault injection: this rank's WRITE reports a NIXL error


class FollowerShards(KVShards):
    """Rank 0's view of the followers' ShardAgents (see the module docstring)."""

    def __init__(self, call_followers: Callable[..., list[Any]]) -> None:
        self._call = call_followers
        self._infos = tuple(self._call("handshake_info"))

    @property
    def infos(self) -> tuple[HandshakeInfo, ...]:
        return self._infos

    def add_peer(self, peer: HandshakeInfo) -> None:
        self._call("add_peer", peer)

    def write(self, peer: str, plan: TransferPlan, *, checksums: bool,
              fail_rank: int | None = None) -> list[ShardOutcome]:
        return list(self._call("write", ShardWrite(peer, plan, checksums, fail_rank)))

    def checksums(self, block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        return list(self._call("checksums", tuple(block_ids)))


@dataclass(frozen=True)
class ShardAgentFactory:
    """Picklable (sent to each follower at spawn): builds that rank's ShardAgent over its KV shard."""

    worker_name: str  # agents are named `<worker_name>-tp<rank>-<random>`
    model_id: str
    poll_idle_s: float = 1e-3
    poll_busy_s: float = 5e-5
    progress_thread: bool | None = None  # TransferConfig.progress_thread (None: on for a GPU KV cache)
    num_threads: int = 0  # TransferConfig.nixl_threads

    def __call__(self, runner: Any, tp: Any) -> ShardAgent:
        layout = KVLayoutInfo.from_spec(runner.kv_spec, self.model_id, tp_size=tp.size, tp_rank=tp.rank)
        name = f"{self.worker_name}-tp{tp.rank}-{uuid.uuid4().hex[:8]}"
        progress = self.progress_thread if self.progress_thread is not None else runner.kv_cache.is_cuda
        return ShardAgent(name, runner.kv_cache, layout, self.poll_idle_s, self.poll_busy_s, progress,
                          self.num_threads)


class ShardAgent:
    """A follower rank's NIXL agent. The rank-service methods run on the follower's main thread
    (one at a time, as rank 0 broadcasts them); every NIXL call runs on this object's own thread."""

    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayoutInfo, poll_idle_s: float,
                 poll_busy_s: float, progress_thread: bool = False, num_threads: int = 0) -> None:
        self._rank = layout.tp_rank
        self._kv_cache = kv_cache
        agent_config = NixlAgentConfig(name=name, progress_thread=progress_thread, num_threads=num_threads)
        self._agent = NixlAgent(agent_config, kv_cache, layout)
        self._info = self._agent.handshake_info
        self._poll_idle_s, self._poll_busy_s = poll_idle_s, poll_busy_s
        self._peers: dict[str, str] = {}  # peer worker's rank 0 agent -> its agent of our rank
        self._writes: list[tuple[NixlTransfer, concurrent.futures.Future[NixlTransfer]]] = []
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"baton-kv-shard{self._rank}", daemon=True)
        self._thread.start()

    # ---- rank service methods (called through TensorParallelRunner.call_followers) ----------------
    def handshake_info(self) -> HandshakeInfo:
        return self._info

    def add_peer(self, peer: HandshakeInfo) -> str:
        """Connect to the peer worker's agent of this rank (rank 0 checked the whole handshake)."""
        mine = peer.ranks[self._rank - 1]
        self._info.check_compatible(mine)
        name = str(self._on_thread(lambda: self._agent.add_peer(mine).name).result(_SETUP_TIMEOUT_S))
        self._peers[peer.agent_name] = name
        return name

    def write(self, order: ShardWrite) -> ShardOutcome:
        """WRITE this rank's shard and wait until it is terminal (its deadline, then a grace for
        NIXL to release it); never raises: rank 0 needs an outcome from every rank."""
        plan = order.plan
        peer = self._peers.get(order.peer)
        if peer is None:
            return ShardOutcome(self._rank, TransferState.FAILED, f"rank {self._rank} has no peer for {order.peer!r}")
        try:
            if self._kv_cache.is_cuda:
                torch.cuda.synchronize(self._kv_cache.device)  # the prefill's KV stores are on the device
            sums = tuple(block_checksums(self._kv_cache, plan.local_block_ids)) if order.checksums else None
            done: concurrent.futures.Future[NixlTransfer] = concurrent.futures.Future()
            fail = order.fail_rank == self._rank
            self._commands.put(lambda: self._start_write(peer, plan, fail, done))
            transfer = done.result(timeout=max(plan.deadline - time.monotonic(), 0.0) + _RELEASE_GRACE_S)
        except concurrent.futures.TimeoutError:
            log.error("rank %d: WRITE of %s still not released by NIXL", self._rank, plan.request_id)
            return ShardOutcome(self._rank, TransferState.FAILED, "WRITE not released by NIXL after its deadline")
        except Exception as e:  # noqa: BLE001 - reported to rank 0 as this rank's outcome
            return ShardOutcome(self._rank, TransferState.FAILED, f"cannot WRITE: {e}")
        return ShardOutcome(self._rank, transfer.state, transfer.reason, sums)

    def checksums(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(block_checksums(self._kv_cache, list(block_ids)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.error("rank %d: KV shard thread did not stop; leaving NIXL open", self._rank)
            return
        for transfer, _ in self._writes:
            transfer.cancel()
        self._agent.close()

    # ---- the agent thread -------------------------------------------------------------------------
    def _on_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self._commands.put(run)
        return fut

    def _start_write(self, peer: str, plan: TransferPlan, fail: bool,
                     done: concurrent.futures.Future[NixlTransfer]) -> None:
        faults = FaultInjector()
        if fail:
            faults.arm(Fault.FAIL_TRANSFER)  # the real failure path of a WRITE NIXL refuses
        try:
            local = block_indices(plan.local_block_ids, self._agent.num_blocks, "local")
            remote = block_indices(plan.remote_block_ids, self._agent.peer(peer).info.num_blocks, "remote")
            handle = self._agent.make_write(peer, local, remote, b"")  # rank 0 notifies for the group
        except Exception as e:
            done.set_exception(e)
            return
        transfer = NixlTransfer(self._agent, peer, plan, handle, faults, time.monotonic, announce=False)
        transfer.post()
        self._writes.append((transfer, done))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                for sender, _ in self._agent.drain_notifications():  # also NIXL's progress call
                    log.debug("rank %d: ignoring a notification from %s", self._rank, sender)
                self._poll_writes()
            except Exception:  # one bad poll must not stop progress for the peers writing into us
                log.exception("rank %d: KV shard poll failed", self._rank)
            time.sleep(self._poll_busy_s if self._writes else self._poll_idle_s)

    def _poll_writes(self) -> None:
        still = []
        for transfer, done in self._writes:
            if transfer.poll().is_terminal:
                done.set_result(transfer)
            else:
                still.append((transfer, done))
        self._writes = still
