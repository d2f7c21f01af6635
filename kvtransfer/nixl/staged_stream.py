"""KV streaming from a multi-rank prefill worker (pipeline or tensor parallel): rank 0 streams its own
blocks per chunk, the follower ranks WRITE theirs once the prompt is prefilled.

Why rank 0 only: a chunk's KV on rank 0 is final when rank 0's step returns (the engine reports it
then, engine/chunk_stream.py), but a later pipeline stage computes that chunk after rank 0 has sent it
the activations, in its own process, and nothing on rank 0 says when. A follower WRITEing a chunk's
blocks would need a per-step handshake with its stage (the step count its runner has finished) and
one order and outcome per part; the followers' part waits instead for the first token, which the last
stage's logits gave, so every stage has computed every chunk by then. Rank 0 holds layer 0 (and, under
TP, its KV heads), so its share streams from the first chunk on.

    PENDING --write(part)--> TRANSFERRING --finish(plan)--> followers ordered
        every rank DONE ---------------------------> DONE      (+ the one DONE notice, every rank's checksums)
        rank 0 or a follower failed / timed out ----> FAILED / TIMED_OUT (+ ABORTED, once every rank let go)
        cancel() -----------------------------------> CANCELLED (+ ABORTED, once every rank let go)

Every end but DONE waits until rank 0's parts are released and every ordered follower has reported its
WRITE's end (or `GROUP_GRACE_S` past the deadline, for one that died), and only then sends the ABORTED
notice: "no more bytes will land" holds on the decode side. A stream cancelled before `finish` never
ordered a follower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtransfer.base import TransferPlan, TransferState
from kvtransfer.faults import FaultInjector
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.nixl.streamed import StreamedTransfer
from kvtransfer.roles import KVStream
from kvtransfer.shards import (
    KVShards,
    ShardOutcome,
    failure_reason,
    order_followers,
    settled_outcomes,
    unreported_ranks,
)


class StagedStream(KVStream):
    """Rank 0's stream (`own`: a `StreamedTransfer` that sends no notice) plus the followers' WRITEs."""

    def __init__(self, own: StreamedTransfer, agent: NixlAgent, shards: KVShards, faults: FaultInjector,
                 clock: Callable[[], float]) -> None:
        self._own, self._agent, self._shards = own, agent, shards
        self._faults, self._clock = faults, clock
        self._pending: tuple[int, ...] = ()  # followers ordered, end not yet reported
        self._outcomes: dict[int, ShardOutcome] = {}
        self._ordered = False
        self._notice: TransferNotice | None = None  # the DONE notice, set by finish()
        self._stop: tuple[TransferState, str] | None = None
        self._state, self._reason = TransferState.PENDING, ""
        self.peer = own.peer

    @property
    def request_id(self) -> str:
        return self._own.request_id

    @property
    def attempt(self) -> int:
        return self._own.attempt

    @property
    def num_blocks(self) -> int:
        return self._own.num_blocks

    @property
    def plan(self) -> TransferPlan:
        return self._own.plan

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def moving(self) -> bool:
        """Rank 0's parts, or (once finished) the followers' WRITEs and the notice."""
        if self._state.is_terminal:
            return False
        return self._own.moving or self._notice is not None or self._stop is not None

    def write(self, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> bool:
        if self._stop is not None or self._state.is_terminal:
            return False
        return self._own.write(local_block_ids, remote_block_ids)

    def finish(self, plan: TransferPlan) -> TransferState:
        """Rank 0 posts what is left of its blocks; every follower is ordered to WRITE all of its own."""
        if self._stop is not None or self._state.is_terminal:
            return self.poll()
        self._own.finish(plan)  # InvalidTransferPlanError (nothing posted) propagates, as a stream's
        self._notice = TransferNotice(NoticeKind.DONE, plan.request_id, plan.attempt, plan.num_blocks, plan.payload)
        own = self._own.state
        if own is TransferState.DONE or not own.is_terminal:  # rank 0 has not failed: the followers go
            try:
                self._outcomes = order_followers(self._shards, self.peer, plan,
                                                 checksums=plan.payload.checksums is not None, faults=self._faults)
            except Exception as e:  # noqa: BLE001 - no follower can be trusted to have landed
                self._outcomes = {r: ShardOutcome(r, TransferState.FAILED, f"cannot order: {e}")
                                  for r in unreported_ranks(self._shards, {})}
            self._ordered = True
            self._pending = unreported_ranks(self._shards, self._outcomes)
        return self.poll()

    def cancel(self) -> TransferState:
        if not self._state.is_terminal and self._stop is None:
            self._stop = (TransferState.CANCELLED, "cancelled by its owner")
        return self.poll()

    def poll(self) -> TransferState:
        if self._state.is_terminal:
            return self._state
        own = self._own.poll()
        self._collect_outcomes()
        if self._stop is None and own.is_terminal and own is not TransferState.DONE:
            self._stop = (own, self._own.reason)
        if self._stop is None and (failed := failure_reason(self._outcomes.values())):
            self._stop = (TransferState.FAILED, failed)
        if self._stop is not None:
            return self._wind_down()
        if own is TransferState.DONE and self._ordered and not self._pending:
            return self._complete()
        self._state = TransferState.TRANSFERRING if own is not TransferState.PENDING else own
        return self._state

    def _collect_outcomes(self) -> None:
        if not self._pending:
            return
        reported = settled_outcomes(self._shards, self._own.plan, self._pending, self._clock())
        if reported is not None:
            self._outcomes.update(reported)
            self._pending = ()

    def _wind_down(self) -> TransferState:
        """Stop rank 0's parts; end once they are released and every ordered follower has reported."""
        assert self._stop is not None
        if not self._own.cancel().is_terminal or self._pending:
            return self._state
        state, reason = self._stop
        self._end(state, reason)
        notice = TransferNotice(NoticeKind.ABORTED, self.request_id, self.attempt, self.num_blocks, reason=reason)
        self._send(notice)
        return self._state

    def _complete(self) -> TransferState:
        assert self._notice is not None
        ranks = sorted(self._outcomes)
        notice = self._notice.with_follower_checksums([self._outcomes[r].checksums for r in ranks])
        if self._send(notice):
            return self._end(TransferState.DONE, "")
        return self._end(TransferState.FAILED, "could not send the DONE notice")

    def _send(self, notice: TransferNotice) -> bool:
        try:
            self._agent.send_notification(self.peer, notice.encode())
        except Exception:  # noqa: BLE001 - the peer is gone: its deadline and quarantine cover it
            return False
        return True

    def _end(self, state: TransferState, reason: str) -> TransferState:
        self._state, self._reason = state, reason
        return state
