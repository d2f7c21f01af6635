"""Prefill side over NIXL: WRITE local blocks into a peer's blocks, with a DONE notice.

With tensor or pipeline parallelism (`shards`: every other rank of the worker), this sender is rank
0's: `start` posts rank 0's WRITE without a notice and has every follower post the WRITE of its shard
of the same block ids into the peer's same rank (under pipeline parallelism: its stage's layers into
the peer's rank holding them, kvtransfer/stages.py) (`KVShards.post`: an order to each follower over
its own socket, never the TP control group, so the engine's steps neither hold it nor are held); `poll` collects the
followers' ends (`KVShards.outcomes`) and only if every rank landed sends the one DONE notice
(carrying every rank's checksums, rank-major) that the peer's rank 0 waits for. Any rank failing fails
the transfer (ABORTED notice): the decode side recomputes. A follower that never reports (its process
died) fails it `GROUP_GRACE_S` past the deadline.

No device work here: rank 0's checksums arrive in the plan's payload, computed by the prefill engine
in the step that finished the blocks (a follower checksums its own shard in its own process).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError, InvalidTransferPlanError, PeerBusyError, TransferSetupError
from kvtransfer.faults import FaultInjector
from kvtransfer.heads import describe_layout
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.nixl.sliced import SlicedWrite
from kvtransfer.nixl.staged_stream import StagedStream
from kvtransfer.nixl.streamed import StreamedTransfer
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.roles import KVSender, KVStream, KVTransfer
from kvtransfer.shards import (
    KVShards,
    ShardOutcome,
    failure_reason,
    order_followers,
    settled_outcomes,
    unreported_ranks,
)
from kvtransfer.stages import LayerSlice, stage_route

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """A tensor-parallel WRITE waiting for its followers' ends."""

    transfer: NixlTransfer
    notice: TransferNotice
    pending: tuple[int, ...]  # follower ranks posted, end not yet reported
    outcomes: dict[int, ShardOutcome]  # ranks that ended (failed at post, or reported)


@dataclass(frozen=True)
class SenderConfig:
    close_timeout_s: float = 5.0  # how long close() polls cancelled transfers before giving up

    def __post_init__(self) -> None:
        if self.close_timeout_s < 0:
            raise ValueError(f"close_timeout_s must be >= 0, got {self.close_timeout_s}")


class NixlKVSender(KVSender):
    """See KVSender for the rules. Does not own `agent`: close the agent after the sender."""

    def __init__(
        self,
        agent: NixlAgent,
        config: SenderConfig | None = None,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
        shards: KVShards | None = None,
    ) -> None:
        self._agent = agent
        self._config = config or SenderConfig()
        self._faults = faults or FaultInjector()
        self._clock = clock
        self._shards = shards  # the follower ranks, when this is rank 0 of a tensor-parallel worker
        self._inflight: dict[tuple[str, int], NixlTransfer | StreamedTransfer | StagedStream] = {}
        self._finished_at_start: list[NixlTransfer] = []
        self._groups: dict[tuple[str, int], _Group] = {}  # terminal inside start(); reported by poll()
        self._sliced: dict[tuple[str, int], SlicedWrite] = {}  # head-sliced hand-offs settled by poll()
        self._sliced_ranks: dict[str, tuple[str, ...]] = {}  # peer of another TP size -> its follower agents

    @property
    def handshake_info(self) -> HandshakeInfo:
        """This worker's: rank 0's agent, listing the follower ranks' agents under tensor parallelism."""
        return _group_info(self._agent, self._shards)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def add_peer(self, info: HandshakeInfo) -> str:
        mine = self.handshake_info
        mine.check_group_compatible(info)
        known = info.agent_name in self._agent.peer_names()
        if mine.is_head_sliced(info):
            return self._add_sliced_peer(mine, info, known)
        name = self._agent.add_peer(info).name
        if self._shards is not None and not known:
            try:
                self._shards.add_peer(info)
            except Exception:
                self._agent.remove_peer(name)  # all ranks or none: a retried handshake starts afresh
                raise
        return name

    def _add_sliced_peer(self, mine: HandshakeInfo, info: HandshakeInfo, known: bool) -> str:
        """A decode worker of another TP size: this rank writes a head range into each of its ranks."""
        if self._shards is not None:  # a gather: each decode rank from several prefill ranks (not built)
            built = "only from a single-rank prefill worker"
            found = [("tp_size", mine.layout.tp_size, info.layout.tp_size),
                     ("head-sliced transfer", built, describe_layout(info.layout))]
            raise IncompatiblePeerError(info.agent_name, found)
        names = [info.agent_name, *(rank.agent_name for rank in info.ranks)]
        if not known:
            try:
                for rank_info in (info, *info.ranks):
                    self._agent.add_peer(rank_info)
            except Exception:
                for added in names:  # all ranks or none: a retried handshake starts afresh
                    self._agent.remove_peer(added)
                raise
            self._sliced_ranks[info.agent_name] = tuple(names[1:])
        return info.agent_name

    def remove_peer(self, peer: str) -> None:
        busy = [t.request_id for t in self._inflight.values() if t.peer == peer]
        if busy:
            raise PeerBusyError(f"peer {peer!r} still has {len(busy)} transfers in flight: {busy[:5]}")
        for rank in self._sliced_ranks.pop(peer, ()):
            self._agent.remove_peer(rank)
        self._agent.remove_peer(peer)

    def start(self, peer: str, plan: TransferPlan) -> KVTransfer:
        key = (plan.request_id, plan.attempt)
        if key in self._inflight:
            raise InvalidTransferPlanError(f"{plan.request_id!r} attempt {plan.attempt} is already in flight")
        remote = self._agent.peer(peer)
        local_idx = block_indices(plan.local_block_ids, self._agent.num_blocks, "local")
        remote_idx = block_indices(plan.remote_block_ids, remote.info.num_blocks, "remote")
        notice = TransferNotice(NoticeKind.DONE, plan.request_id, plan.attempt, plan.num_blocks, plan.payload)
        if self.handshake_info.is_head_sliced(remote.info):
            sliced = SlicedWrite.start(self._agent, remote.info, plan, notice, self._faults, self._clock)
            self._sliced[key] = sliced
            transfer, state = sliced.primary, sliced.primary.state
        elif self._shards is None:
            handle = self._agent.make_write(peer, local_idx, remote_idx, notice.encode())
            transfer = NixlTransfer(self._agent, peer, plan, handle, self._faults, self._clock)
            state = transfer.post()
        else:  # no notice: see the docstring; rank 0 holds layer 0, so it writes into the peer's rank 0
            layers = self._rank0_layers(remote.info)
            handle = self._agent.make_write(peer, local_idx, remote_idx, b"", layers=layers)
            transfer = NixlTransfer(self._agent, peer, plan, handle, self._faults, self._clock, group=True)
            state = self._write_group(transfer, notice, self._shards)
        if state.is_terminal:
            self._finished_at_start.append(transfer)
        else:
            self._inflight[key] = transfer
        return transfer

    def _rank0_layers(self, peer: HandshakeInfo) -> LayerSlice | None:
        """Rank 0's layers inside the peer's rank 0 blocks (None: the same layers, whole blocks)."""
        route = stage_route(self.handshake_info.layout, [r.layout for r in peer.all_ranks])
        assert route is not None and route.dst_rank == 0, f"add_peer checked the stages: {route}"
        return route.layers

    def open_stream(self, peer: str, request_id: str, attempt: int, deadline: float) -> KVStream:
        """One agent streams per chunk. A multi-rank worker (tensor or pipeline parallel) streams rank 0's
        blocks per chunk and has its followers WRITE theirs at `finish` (kvtransfer/nixl/staged_stream.py).
        Not into a decode worker of another TP size (TransferSetupError)."""
        key = (request_id, attempt)
        if key in self._inflight:
            raise InvalidTransferPlanError(f"{request_id!r} attempt {attempt} is already in flight")
        info = self._agent.peer(peer).info  # UnknownPeerError first
        if self.handshake_info.is_head_sliced(info):
            raise TransferSetupError("KV streaming per chunk is not implemented for a decode worker of another TP size")
        if self._shards is None:
            stream: StreamedTransfer | StagedStream = StreamedTransfer(self._agent, peer, request_id, attempt,
                                                                      deadline, self._faults, self._clock)
        else:
            own = StreamedTransfer(self._agent, peer, request_id, attempt, deadline, self._faults, self._clock,
                                   layers=self._rank0_layers(info), announce=False)
            stream = StagedStream(own, self._agent, self._shards, self._faults, self._clock)
        self._inflight[key] = stream
        return stream

    def _write_group(self, transfer: NixlTransfer, notice: TransferNotice, shards: KVShards) -> TransferState:
        """Rank 0's WRITE is posted first, so every rank's runs at once; the transfer settles in `poll`
        once every follower reported its end, which is when an abort of it may take effect."""
        if transfer.post().is_terminal:
            return transfer.state  # rank 0 failed at once: the followers write nothing
        plan = transfer.plan
        try:
            ended = order_followers(shards, transfer.peer, plan, checksums=notice.checksums is not None,
                                    faults=self._faults)
        except Exception as e:  # the group call broke: no follower can be trusted to have landed
            log.exception("follower WRITEs of %s failed", plan.request_id)
            return transfer.settle_group(f"follower ranks' WRITE failed: {e}", None)
        group = _Group(transfer, notice, unreported_ranks(shards, ended), dict(ended))
        self._groups[(plan.request_id, plan.attempt)] = group
        return self._settle_when_reported(group, shards)

    def _settle_when_reported(self, group: _Group, shards: KVShards) -> TransferState:
        transfer, plan = group.transfer, group.transfer.plan
        reported = settled_outcomes(shards, plan, group.pending, self._clock())
        if reported is None:
            return transfer.poll()
        del self._groups[(plan.request_id, plan.attempt)]
        outcomes = [{**group.outcomes, **reported}[r] for r in sorted({**group.outcomes, **reported})]
        return self._settle_group(transfer, group.notice, outcomes)

    def _settle_group(self, transfer: NixlTransfer, notice: TransferNotice,
                      outcomes: list[ShardOutcome]) -> TransferState:
        if why := failure_reason(outcomes):
            return transfer.settle_group(why, None)
        notice = notice.with_follower_checksums([o.checksums for o in outcomes])
        return transfer.settle_group("", notice.encode())

    def poll(self) -> list[KVTransfer]:
        self._agent.progress()  # also completes our outgoing abort notices when nothing is in flight
        finished: list[KVTransfer] = list(self._finished_at_start)
        self._finished_at_start.clear()
        if self._shards is not None:
            for group in list(self._groups.values()):
                self._settle_when_reported(group, self._shards)
        for key, sliced in list(self._sliced.items()):
            if sliced.settle_if_done(self._settle_group):
                del self._sliced[key]
        for key, transfer in list(self._inflight.items()):
            if transfer.poll().is_terminal:
                del self._inflight[key]
                finished.append(transfer)
        return finished

    def close(self) -> None:
        for transfer in self._inflight.values():
            transfer.cancel()
        for sliced in self._sliced.values():
            sliced.cancel_others()
        give_up = self._clock() + self._config.close_timeout_s
        while self._inflight and self._clock() < give_up:
            self.poll()
            time.sleep(0.001)
        if self._inflight:
            log.error("closing KV sender with %d transfers NIXL would not release", len(self._inflight))
            return
        for peer in self._agent.peer_names():
            self._agent.remove_peer(peer)


def _group_info(agent: NixlAgent, shards: KVShards | None) -> HandshakeInfo:
    info = agent.handshake_info
    return info if shards is None else dataclasses.replace(info, ranks=shards.infos)
