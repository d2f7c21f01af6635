"""KV transfer across a tensor-parallel worker's ranks: one NIXL agent per rank, each over its own KV shard.

Rank r of a prefill worker writes its shard of a request's blocks into rank r of the decode worker
(homogeneous TP: both have tp_size ranks and shard KV heads the same way). Under pipeline parallelism
the ranks are world ranks (stage * tp_size + tensor rank) and each writes its stage's layers into the
decode rank of its tensor rank that holds them: the same world rank when both split layers alike,
else a layer slice of that rank's blocks (kvtransfer/stages.py). Rank 0's KV link owns
the sender/receiver and the one notification per request; the follower ranks are reached through
the engine's tensor-parallel control group (`TensorParallelRunner.call_followers`):

- `ShardAgentFactory` is handed to the engine, which builds a `ShardAgent` in every follower process
  right after its model runner (its KV cache exists by then): the follower's NIXL agent, registered
  over its KV shard, driven by a polling thread of its own.
- `FollowerShards` is rank 0's `KVShards`: `add_peer` and `checksums` are one broadcast + gather over
  the control group each (a typed request: `HandshakeInfoRequest`, `OrderInboxRequest`, `AddPeer`,
  `ChecksumsRequest`, which the `ShardAgent` dispatches on), serialised with the engine's steps by the
  runner's group lock. `post` is not: it sends each follower its WRITE order (`ShardWrite`) over the
  follower's own Unix socket (kvtransfer/nixl/inbox.py), which the follower's agent thread acts on at
  once, and how the WRITE ended travels back over a Unix socket of rank 0's own (`OutcomeInbox`). So a
  WRITE neither holds the engine's next step nor waits for the one in progress. (Posting over the control
  group made a follower's WRITE wait for the step holding the group lock, 1.6-2.3 s on a loaded CPU,
  while the plan's deadline ran: the WRITE was then posted with its deadline spent and ended TIMED_OUT
  "after 0.005 s in flight".)

Passive targets: with NIXL's progress thread off, a decode follower's agent must keep progressing
(UCX wire-up, the peer's WRITE) although nothing on that rank ever waits for a transfer; its
`ShardAgent` thread polls every `poll_idle_s` for the process's whole life, and drops the
notifications it drains (none are expected: followers never notify).
Clocks: a plan's deadline is on rank 0's monotonic clock; the ranks of a worker share one host, and
CLOCK_MONOTONIC is system-wide on Linux.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import Any, TypeVar

import torch

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError
from kvtransfer.faults import Fault, FaultInjector, corrupt_block_byte
from kvtransfer.integrity import block_checksums, group_checksums
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl import NixlAgent, NixlAgentConfig
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.inbox import UnixInbox
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.shards import KVShards, ShardOutcome
from kvtransfer.stages import ChecksumGroup, LayerSlice, stage_route

log = logging.getLogger(__name__)
AgentFactory = Callable[[NixlAgentConfig, torch.Tensor, KVLayoutInfo], NixlAgent]
_SETUP_TIMEOUT_S = 30.0  # add_peer on the agent thread (connection wire-up is non-blocking)
_Reply = TypeVar("_Reply")


@dataclass(frozen=True)
class ShardWrite:
    """Rank 0's order to every follower: WRITE your shard of `plan` into the peer's same rank."""

    peer: str  # the peer worker's rank 0 agent (each follower maps it to the peer's agent of its rank)
    plan: TransferPlan
    checksums: bool
    fail_rank: int | None = None  # fault injection: this rank's WRITE reports a NIXL error
    report_to: str = ""  # rank 0's OutcomeInbox address: where the follower reports the WRITE's end
    authkey: bytes = b""


@dataclass(frozen=True)
class HandshakeInfoRequest:
    """Rank 0 asks every follower for its agent's handshake info (reply: HandshakeInfo)."""


@dataclass(frozen=True)
class AddPeer:
    """Connect to the peer worker's agent of your rank (reply: the NIXL peer name)."""

    peer: HandshakeInfo  # the peer's whole handshake, its follower ranks' infos included


@dataclass(frozen=True)
class OrderInboxRequest:
    """Where does your agent thread take WRITE orders (reply: OrderInbox)."""


@dataclass(frozen=True)
class OrderInbox:
    """A follower's order socket: rank 0 sends its `ShardWrite`s there, not over the control group."""

    address: str
    authkey: bytes


@dataclass(frozen=True)
class ChecksumsRequest:
    """The checksums of these blocks for the groups on your rank (reply: one per block per group of
    yours, group after group; kvtransfer/integrity.py)."""

    block_ids: tuple[int, ...]
    groups: tuple[ChecksumGroup, ...]
    corrupt_rank: int | None = None  # fault injection: that rank flips a byte of the first block first


# What a ShardAgent serves over the control group (`ShardAgent.handle`); ShardWrite goes to its OrderInbox.
ShardRequest = HandshakeInfoRequest | OrderInboxRequest | AddPeer | ChecksumsRequest


class OutcomeInbox:
    """Rank 0's end of the followers' outcome channel (a `UnixInbox`: the followers get its address and
    key in each ShardWrite). Thread-safe: its readers fill it, the KV link thread takes from it."""

    def __init__(self) -> None:
        self._socket = UnixInbox(self._store, "baton-kv-shard-inbox")
        self.address, self.authkey = self._socket.address, self._socket.authkey
        self._outcomes: dict[tuple[str, int], dict[int, ShardOutcome]] = {}
        self._lock = threading.Lock()

    def take(self, key: tuple[str, int], ranks: Sequence[int]) -> dict[int, ShardOutcome] | None:
        with self._lock:
            got = self._outcomes.get(key, {})
            if any(r not in got for r in ranks):
                return None
            del self._outcomes[key]
        return {r: got[r] for r in ranks}

    def forget(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._outcomes.pop(key, None)

    def close(self) -> None:
        self._socket.close()

    def _store(self, message: tuple[tuple[str, int], ShardOutcome]) -> None:
        key, outcome = message
        with self._lock:
            self._outcomes.setdefault(key, {})[outcome.rank] = outcome


class FollowerShards(KVShards):
    """Rank 0's view of the followers' ShardAgents (see the module docstring)."""

    def __init__(self, call_followers: Callable[[ShardRequest], list[object]]) -> None:
        self._call = call_followers
        self._infos = tuple(self._replies(HandshakeInfoRequest(), HandshakeInfo))
        self._order_inboxes = tuple(self._replies(OrderInboxRequest(), OrderInbox))
        self._orders: dict[int, Connection] = {}  # follower rank -> our connection to its order inbox
        self._inbox: OutcomeInbox | None = None  # opened by the first post (receivers never post)

    @property
    def infos(self) -> tuple[HandshakeInfo, ...]:
        return self._infos

    def add_peer(self, peer: HandshakeInfo) -> None:
        self._replies(AddPeer(peer), str)

    def post(self, peer: str, plan: TransferPlan, *, checksums: bool,
             fail_rank: int | None = None) -> dict[int, ShardOutcome]:
        if self._inbox is None:
            self._inbox = OutcomeInbox()
        order = ShardWrite(peer, plan, checksums, fail_rank, self._inbox.address, self._inbox.authkey)
        failed = {}
        for rank, inbox in enumerate(self._order_inboxes, start=1):
            try:
                conn = self._orders.get(rank) or Client(inbox.address, family="AF_UNIX", authkey=inbox.authkey)
                self._orders[rank] = conn
                conn.send(order)
            except OSError as e:  # the follower is gone: it writes nothing
                self._orders.pop(rank, None)
                failed[rank] = ShardOutcome(rank, TransferState.FAILED, f"cannot reach rank {rank}: {e}")
        return failed

    def outcomes(self, request_id: str, attempt: int, ranks: Sequence[int]) -> dict[int, ShardOutcome] | None:
        return self._inbox.take((request_id, attempt), ranks) if self._inbox is not None else None

    def forget(self, request_id: str, attempt: int) -> None:
        if self._inbox is not None:
            self._inbox.forget((request_id, attempt))

    def checksums(self, block_ids: Sequence[int], groups: Sequence[ChecksumGroup],
                  corrupt_rank: int | None = None) -> list[tuple[int, ...]]:
        return list(self._replies(ChecksumsRequest(tuple(block_ids), tuple(groups), corrupt_rank), tuple))

    def _replies(self, request: ShardRequest, kind: type[_Reply]) -> list[_Reply]:
        return _checked(request, self._call(request), kind)


def _checked(request: ShardRequest, replies: list[object], kind: type[_Reply]) -> list[_Reply]:
    """The followers' replies, each checked to be a `kind` (a follower answering something else fails
    here, not somewhere downstream)."""
    wrong = [type(r).__name__ for r in replies if not isinstance(r, kind)]
    if wrong:
        raise TypeError(f"{type(request).__name__}: followers replied {wrong}, not {kind.__name__}")
    return [r for r in replies if isinstance(r, kind)]


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
        stage = tp.pipeline
        layout = KVLayoutInfo.from_spec(runner.kv_spec, self.model_id, tp_size=tp.size, tp_rank=tp.rank,
                                        pp_size=stage.size, pp_rank=stage.rank,
                                        first_layer=stage.layers(runner.model_config.num_layers).start)
        name = f"{self.worker_name}-r{layout.world_rank}-{uuid.uuid4().hex[:8]}"
        progress = self.progress_thread if self.progress_thread is not None else runner.kv_cache.is_cuda
        return ShardAgent(name, runner.kv_cache, layout, self.poll_idle_s, self.poll_busy_s, progress,
                          self.num_threads)


class ShardAgent:
    """A follower rank's NIXL agent. The rank-service methods run on the follower's main thread
    (one at a time, as rank 0 broadcasts them); every NIXL call runs on this object's own thread."""

    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayoutInfo, poll_idle_s: float,
                 poll_busy_s: float, progress_thread: bool = False, num_threads: int = 0,
                 agent_factory: AgentFactory = NixlAgent) -> None:
        self._rank = layout.world_rank
        self._kv_cache = kv_cache
        agent_config = NixlAgentConfig(name=name, progress_thread=progress_thread, num_threads=num_threads)
        self._agent = agent_factory(agent_config, kv_cache, layout)  # the memory transport's agent in tests
        self._info = self._agent.handshake_info
        self._poll_idle_s, self._poll_busy_s = poll_idle_s, poll_busy_s
        # peer worker's rank 0 agent -> (its agent we write into, the layers of its blocks we write)
        self._peers: dict[str, tuple[str, LayerSlice | None]] = {}
        self._writes: list[tuple[NixlTransfer, _Report]] = []
        self._reporters: dict[str, Connection] = {}  # rank 0's inbox address -> our connection (agent thread)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._orders = UnixInbox(lambda order: self._commands.put(lambda: self._take_order(order)),
                                 f"baton-kv-shard{self._rank}-orders")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"baton-kv-shard{self._rank}", daemon=True)
        self._thread.start()

    # ---- the rank service (called through TensorParallelRunner.call_followers) --------------------
    def handle(self, request: object) -> object:
        """The reply to one of rank 0's `ShardRequest`s."""
        if isinstance(request, OrderInboxRequest):
            return self.order_inbox()
        if isinstance(request, AddPeer):
            return self.add_peer(request.peer)
        if isinstance(request, ChecksumsRequest):
            return self.checksums(request)
        if isinstance(request, HandshakeInfoRequest):
            return self.handshake_info()
        raise TypeError(f"a KV shard agent serves {ShardRequest}, not {type(request).__name__}")

    def handshake_info(self) -> HandshakeInfo:
        return self._info

    def add_peer(self, peer: HandshakeInfo) -> str:
        """Connect to the peer worker's agent that holds this rank's layers of its tensor rank (the same
        world rank when both split layers alike; kvtransfer/stages.py). Rank 0 checked the handshake."""
        route = stage_route(self._info.layout, [r.layout for r in peer.all_ranks])
        if route is None:
            raise IncompatiblePeerError(peer.agent_name, [("layer ranges", self._info.layout.layers, "no rank")])
        target = peer.all_ranks[route.dst_rank]
        if route.layers is None:
            self._info.check_compatible(target)
        name = str(self._on_thread(lambda: self._agent.add_peer(target).name).result(_SETUP_TIMEOUT_S))
        self._peers[peer.agent_name] = (name, route.layers)
        return name

    def order_inbox(self) -> OrderInbox:
        """Where rank 0 sends this rank its WRITE orders: not the control group, whose calls wait for the
        engine's step (kvtransfer/nixl/inbox.py)."""
        return OrderInbox(self._orders.address, self._orders.authkey)

    def checksums(self, request: ChecksumsRequest) -> tuple[int, ...]:
        ids = list(request.block_ids)
        if request.corrupt_rank == self._rank:
            corrupt_block_byte(self._kv_cache, ids[0])
        return tuple(s for g in request.groups if g.rank == self._rank for s in group_checksums(self._kv_cache, ids, g))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        if self._thread.is_alive():
            log.error("rank %d: KV shard thread did not stop; leaving NIXL open", self._rank)
            return
        self._orders.close()
        for transfer, _ in self._writes:
            transfer.cancel()
        for conn in self._reporters.values():
            conn.close()
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

    def _take_order(self, order: ShardWrite) -> None:
        """Post this rank's WRITE of `order` (on the agent thread, as its order arrives). Never raises:
        rank 0 needs an outcome from every rank, so a WRITE that cannot be posted is reported failed."""
        plan = order.plan
        report = _Report(order.report_to, order.authkey, (plan.request_id, plan.attempt), None)
        try:
            if order.peer not in self._peers:
                raise KeyError(f"rank {self._rank} has no peer for {order.peer!r}")
            peer, layers = self._peers[order.peer]
            if self._kv_cache.is_cuda:
                torch.cuda.synchronize(self._kv_cache.device)  # the prefill's KV stores are on the device
            if order.checksums:
                report = dataclasses.replace(report, checksums=tuple(block_checksums(self._kv_cache,
                                                                                     plan.local_block_ids)))
            self._start_write(peer, layers, plan, order.fail_rank == self._rank, report)
        except Exception as e:  # noqa: BLE001 - reported to rank 0 as this rank's outcome
            self._report(report, ShardOutcome(self._rank, TransferState.FAILED, f"cannot WRITE: {e}"))

    def _start_write(self, peer: str, layers: LayerSlice | None, plan: TransferPlan, fail: bool,
                     report: _Report) -> None:
        faults = FaultInjector()
        if fail:
            faults.arm(Fault.FAIL_TRANSFER)  # the real failure path of a WRITE NIXL refuses
        self._reporter(report)  # connect first: a WRITE whose end cannot be told is never posted
        local = block_indices(plan.local_block_ids, self._agent.num_blocks, "local")
        remote = block_indices(plan.remote_block_ids, self._agent.peer(peer).info.num_blocks, "remote")
        handle = self._agent.make_write(peer, local, remote, b"", layers=layers)  # rank 0 notifies for the group
        transfer = NixlTransfer(self._agent, peer, plan, handle, faults, time.monotonic, announce=False)
        transfer.post()
        self._writes.append((transfer, report))

    def _report(self, report: _Report, outcome: ShardOutcome) -> None:
        try:
            self._reporter(report).send((report.key, outcome))
        except OSError as e:  # rank 0 is gone: its transfer is over anyway
            log.warning("rank %d: cannot report the end of %s: %s", self._rank, report.key, e)

    def _reporter(self, report: _Report) -> Connection:
        conn = self._reporters.get(report.address)
        if conn is None:
            conn = self._reporters[report.address] = Client(report.address, family="AF_UNIX", authkey=report.authkey)
        return conn

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
        for transfer, report in self._writes:
            if transfer.poll().is_terminal:
                self._report(report, ShardOutcome(self._rank, transfer.state, transfer.reason, report.checksums))
            else:
                still.append((transfer, report))
        self._writes = still


@dataclass(frozen=True)
class _Report:
    """Where and what a follower tells rank 0 once its WRITE is terminal."""

    address: str
    authkey: bytes
    key: tuple[str, int]  # (request id, attempt)
    checksums: tuple[int, ...] | None
