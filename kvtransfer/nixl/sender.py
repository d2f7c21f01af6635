"""Prefill side over NIXL: WRITE local blocks into a peer's blocks, with a DONE notice.

With tensor parallelism (`shards`), this sender is rank 0's: `start` posts rank 0's WRITE without a
notice, has every follower WRITE its shard of the same block ids into the peer's same rank and wait
for it (`KVShards.write`, blocking, bounded by the plan's deadline), and only if every rank landed
sends the one DONE notice (carrying every rank's checksums, rank-major) that the peer's rank 0
waits for. Any rank failing fails the transfer (ABORTED notice): the decode side recomputes.

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
from kvtransfer.errors import InvalidTransferPlanError, PeerBusyError
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.roles import KVSender, KVTransfer
from kvtransfer.shards import KVShards

log = logging.getLogger(__name__)


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
        self._inflight: dict[tuple[str, int], NixlTransfer] = {}
        self._finished_at_start: list[NixlTransfer] = []  # terminal inside start(); reported by poll()

    @property
    def handshake_info(self) -> HandshakeInfo:
        """This worker's: rank 0's agent, listing the follower ranks' agents under tensor parallelism."""
        return _group_info(self._agent, self._shards)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def add_peer(self, info: HandshakeInfo) -> str:
        self.handshake_info.check_group_compatible(info)
        known = info.agent_name in self._agent.peer_names()
        name = self._agent.add_peer(info).name
        if self._shards is not None and not known:
            try:
                self._shards.add_peer(info)
            except Exception:
                self._agent.remove_peer(name)  # all ranks or none: a retried handshake starts afresh
                raise
        return name

    def remove_peer(self, peer: str) -> None:
        busy = [t.plan.request_id for t in self._inflight.values() if t.peer == peer]
        if busy:
            raise PeerBusyError(f"peer {peer!r} still has {len(busy)} transfers in flight: {busy[:5]}")
        self._agent.remove_peer(peer)

    def start(self, peer: str, plan: TransferPlan) -> KVTransfer:
        key = (plan.request_id, plan.attempt)
        if key in self._inflight:
            raise InvalidTransferPlanError(f"{plan.request_id!r} attempt {plan.attempt} is already in flight")
        remote = self._agent.peer(peer)
        local_idx = block_indices(plan.local_block_ids, self._agent.num_blocks, "local")
        remote_idx = block_indices(plan.remote_block_ids, remote.info.num_blocks, "remote")
        notice = TransferNotice(NoticeKind.DONE, plan.request_id, plan.attempt, plan.num_blocks, plan.payload)
        if self._shards is None:
            handle = self._agent.make_write(peer, local_idx, remote_idx, notice.encode())
            transfer = NixlTransfer(self._agent, peer, plan, handle, self._faults, self._clock)
            state = transfer.post()
        else:
            handle = self._agent.make_write(peer, local_idx, remote_idx, b"")  # no notice: see the docstring
            transfer = NixlTransfer(self._agent, peer, plan, handle, self._faults, self._clock, group=True)
            state = self._write_group(transfer, notice, self._shards)
        if state.is_terminal:
            self._finished_at_start.append(transfer)
        else:
            self._inflight[key] = transfer
        return transfer

    def _write_group(self, transfer: NixlTransfer, notice: TransferNotice, shards: KVShards) -> TransferState:
        """Rank 0's WRITE is posted first, so every rank's runs at once; the followers' call returns
        once theirs are terminal, which is when an abort of this transfer may take effect."""
        if transfer.post().is_terminal:
            return transfer.state  # rank 0 failed at once: the followers write nothing
        plan = transfer.plan
        fail_rank = len(shards.infos) if self._faults.should_inject(Fault.FAIL_SHARD_TRANSFER) else None
        try:
            outcomes = shards.write(transfer.peer, plan, checksums=notice.checksums is not None, fail_rank=fail_rank)
        except Exception as e:  # the group call broke: no follower can be trusted to have landed
            log.exception("follower WRITEs of %s failed", plan.request_id)
            return transfer.settle_group(f"follower ranks' WRITE failed: {e}", None)
        failed = [o for o in outcomes if o.state is not TransferState.DONE]
        if failed:
            why = "; ".join(f"rank {o.rank} {o.state.value}: {o.reason}" for o in failed)
            return transfer.settle_group(why, None)
        if notice.checksums is not None:
            sums = list(notice.checksums)
            for outcome in outcomes:
                sums.extend(outcome.checksums or ())
            payload = dataclasses.replace(notice.payload, checksums=tuple(sums))
            notice = dataclasses.replace(notice, payload=payload)
        return transfer.settle_group("", notice.encode())

    def poll(self) -> list[KVTransfer]:
        self._agent.progress()  # also completes our outgoing abort notices when nothing is in flight
        finished: list[KVTransfer] = list(self._finished_at_start)
        self._finished_at_start.clear()
        for key, transfer in list(self._inflight.items()):
            if transfer.poll().is_terminal:
                del self._inflight[key]
                finished.append(transfer)
        return finished

    def close(self) -> None:
        for transfer in self._inflight.values():
            transfer.cancel()
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
