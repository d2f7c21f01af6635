"""Prefill side over NIXL: WRITE local blocks into a peer's blocks, with a DONE notice."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.base import HandshakeInfo, KVSender, KVTransfer, TransferPlan
from kvtransfer.errors import InvalidTransferPlanError, PeerBusyError
from kvtransfer.faults import FaultInjector
from kvtransfer.integrity import block_checksums
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.nixl.transfer import NixlTransfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderConfig:
    checksums: bool = False  # checksum source blocks into the notice (one device sync per 32 blocks)
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
    ) -> None:
        self._agent = agent
        self._config = config or SenderConfig()
        self._faults = faults or FaultInjector()
        self._clock = clock
        self._inflight: dict[tuple[str, int], NixlTransfer] = {}
        self._finished_at_start: list[NixlTransfer] = []  # terminal inside start(); reported by poll()

    @property
    def handshake_info(self) -> HandshakeInfo:
        return self._agent.handshake_info

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def add_peer(self, info: HandshakeInfo) -> str:
        self.handshake_info.check_compatible(info)
        return self._agent.add_peer(info).name

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
        checksums = None
        if self._config.checksums:
            checksums = tuple(block_checksums(self._agent.kv_cache, plan.local_block_ids))
        notice = TransferNotice(NoticeKind.DONE, plan.request_id, plan.attempt, plan.num_blocks, checksums)
        handle = self._agent.make_write(peer, local_idx, remote_idx, notice.encode())
        transfer = NixlTransfer(self._agent, peer, plan, handle, self._faults, self._clock)
        if transfer.post().is_terminal:
            self._finished_at_start.append(transfer)
        else:
            self._inflight[key] = transfer
        return transfer

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
