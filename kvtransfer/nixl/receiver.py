"""Decode side over NIXL: expose the KV blocks, detect arrivals by notification, guard reuse.

Pure bookkeeping on the polling thread: no device work. A DONE notice of an expected attempt is
reported as `LandedKV` with its payload (checksums, first token); the owner verifies the checksums
on its engine thread (kvtransfer.integrity.LandedVerifier) before using the blocks.

With tensor parallelism this receiver is rank 0's; the follower ranks' agents are passive targets
(the sender's follower r writes into our follower r) and their owners keep them progressing. The one
notice comes from the sender's rank 0 once every rank landed; its checksums cover every rank's shard
(rank-major), in groups whose place on this worker follows from the sender's handshake (its stage
split: `LandedKV.checksum_groups`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtransfer.base import HandshakeInfo, LandedKV, TransferFailure, TransferState
from kvtransfer.errors import InvalidTransferPlanError, MalformedNotificationError
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.roles import KVReceiver
from kvtransfer.shards import KVShards
from kvtransfer.stages import ChecksumGroup, checksum_groups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverConfig:
    # How long released blocks of a request without a DONE/ABORTED notice stay unusable. Covers a
    # sender that died mid-WRITE; must exceed the senders' transfer timeout.
    quarantine_s: float = 30.0

    def __post_init__(self) -> None:
        if self.quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {self.quarantine_s}")


@dataclass
class _Expected:
    request_id: str
    attempt: int
    block_ids: tuple[int, ...]
    deadline: float
    state: TransferState = TransferState.PENDING
    write_finished: bool = False  # a DONE or ABORTED notice for this attempt arrived: nothing more lands


class NixlKVReceiver(KVReceiver):
    """See KVReceiver for the rules. Does not own `agent`: close the agent after the receiver."""

    def __init__(
        self,
        agent: NixlAgent,
        config: ReceiverConfig | None = None,
        faults: FaultInjector | None = None,
        clock: Callable[[], float] = time.monotonic,
        shards: KVShards | None = None,
    ) -> None:
        self._agent = agent
        self._shards = shards  # the follower ranks, when this is rank 0 of a tensor-parallel worker
        self._config = config or ReceiverConfig()
        self._faults = faults or FaultInjector()
        self._clock = clock
        self._expected: dict[str, _Expected] = {}
        self._quarantine: dict[tuple[str, int], float] = {}  # (request, attempt) -> reusable at
        self._arrived: dict[str, LandedKV] = {}
        self._failed: dict[str, TransferFailure] = {}
        self._reclaimable: set[str] = set()
        # accepted sender (its rank 0's agent) -> where its notices' checksum groups lie on this worker
        self._checksum_groups: dict[str, tuple[ChecksumGroup, ...]] = {}
        self.stale_notices = 0  # notices for requests not expected (late, released, other attempt)
        self.malformed_notices = 0

    @property
    def handshake_info(self) -> HandshakeInfo:
        info = self._agent.handshake_info
        return info if self._shards is None else dataclasses.replace(info, ranks=self._shards.infos)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantine)

    def accept_peer(self, info: HandshakeInfo) -> str:
        mine = self.handshake_info
        mine.check_group_compatible(info, sending=False)
        self._checksum_groups[info.agent_name] = checksum_groups([r.layout for r in info.all_ranks],
                                                                 [r.layout for r in mine.all_ranks])
        return info.agent_name

    def expect(self, request_id: str, block_ids: Sequence[int], deadline: float, attempt: int = 0) -> None:
        if request_id in self._expected:
            raise InvalidTransferPlanError(f"{request_id!r} is already expected; release it first")
        ids = tuple(block_ids)
        if not ids or len(set(ids)) != len(ids):
            raise InvalidTransferPlanError(f"{request_id!r}: block ids must be non-empty and distinct")
        block_indices(ids, self._agent.num_blocks, "local")
        self._expected[request_id] = _Expected(request_id, attempt, ids, deadline)

    def poll_arrivals(self) -> list[LandedKV]:
        self._progress()
        arrived, self._arrived = self._arrived, {}
        return list(arrived.values())

    def poll_failures(self) -> dict[str, TransferFailure]:
        self._progress()
        failed, self._failed = self._failed, {}
        return failed

    def state(self, request_id: str) -> TransferState | None:
        entry = self._expected.get(request_id)
        return None if entry is None else entry.state

    def release(self, request_id: str, *, sender_idle: bool = False) -> bool:
        self._progress()  # a DONE/ABORTED notice already received ends the danger window now, not later
        entry = self._expected.pop(request_id, None)
        self._arrived.pop(request_id, None)
        self._failed.pop(request_id, None)
        if entry is None:  # unknown, or released before and possibly still quarantined
            quarantined = [key for key in self._quarantine if key[0] == request_id]
            if sender_idle:
                for key in quarantined:
                    del self._quarantine[key]  # freed now, so never reported by poll_reclaimable
            return sender_idle or not quarantined
        if entry.write_finished or sender_idle:
            return True
        self._quarantine[(request_id, entry.attempt)] = self._clock() + self._config.quarantine_s
        return False

    def poll_reclaimable(self) -> set[str]:
        self._progress()
        out, self._reclaimable = self._reclaimable, set()
        return out

    def close(self) -> None:
        self._progress()
        if self._quarantine or any(not e.write_finished for e in self._expected.values()):
            log.warning(
                "closing KV receiver while peers may still write: %d quarantined, %d expected",
                len(self._quarantine),
                len(self._expected),
            )
        self._expected.clear()
        self._quarantine.clear()

    def _progress(self) -> None:
        for sender, raw in self._agent.drain_notifications():
            self._on_notification(sender, raw)
        now = self._clock()
        for entry in self._expected.values():
            if entry.state is TransferState.PENDING and now >= entry.deadline:
                self._fail(entry, TransferState.TIMED_OUT, "no notification before the deadline")
        for key, until in list(self._quarantine.items()):
            if now >= until:
                del self._quarantine[key]
                self._reclaimable.add(key[0])

    def _on_notification(self, sender: str, raw: bytes) -> None:
        try:
            notice = TransferNotice.decode(raw)
        except MalformedNotificationError as e:
            self.malformed_notices += 1
            log.warning("ignoring notification from %s: %s", sender, e)
            return
        key = (notice.request_id, notice.attempt)
        if key in self._quarantine:
            del self._quarantine[key]
            self._reclaimable.add(notice.request_id)
            return
        entry = self._expected.get(notice.request_id)
        if entry is None or entry.attempt != notice.attempt:
            self.stale_notices += 1
            log.info("stale %s notice for %s#%d from %s", notice.kind.value, *key, sender)
            return
        if notice.kind is NoticeKind.DONE and self._faults.should_inject(Fault.DROP_NOTIFICATION):
            return
        entry.write_finished = True
        if entry.state is not TransferState.PENDING:
            return  # arrived after our deadline: the blocks are now safe to reuse, nothing else
        if notice.kind is NoticeKind.ABORTED:
            self._fail(entry, TransferState.FAILED, f"sender {sender} aborted: {notice.reason}")
        elif notice.num_blocks != len(entry.block_ids):
            reason = f"sender wrote {notice.num_blocks} blocks, {len(entry.block_ids)} expected"
            self._fail(entry, TransferState.FAILED, reason)
        else:
            entry.state = TransferState.DONE
            self._arrived[entry.request_id] = LandedKV(entry.request_id, entry.attempt, entry.block_ids,
                                                       notice.payload, self._checksum_groups.get(sender, ()))

    def _fail(self, entry: _Expected, state: TransferState, reason: str) -> None:
        entry.state = state
        self._failed[entry.request_id] = TransferFailure(entry.request_id, state, reason)
        log.warning("KV for %s#%d %s: %s", entry.request_id, entry.attempt, state.value, reason)
