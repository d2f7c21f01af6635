"""One request's NIXL WRITE as a polled state machine.

    PENDING --post--> TRANSFERRING --status DONE--> DONE
                           |-------status ERR----> FAILED
                           |-------deadline------> TIMED_OUT   (after NIXL let go of the handle)
                           '-------cancel()------> CANCELLED   (after NIXL let go of the handle)

The NIXL handle is released on every path into a terminal state, and a terminal state is entered
only once the release succeeded: if NIXL refuses to drop an active WRITE, the transfer stays
TRANSFERRING and the release is retried on the next poll (it may then still end DONE: the bytes
landed and the peer got its DONE notice). On every terminal state but DONE the peer is sent an
ABORTED notice, so its blocks can be reclaimed without waiting for its own deadline.
Residual trust: releasing a posted-but-unfinished handle relies on NIXL's cancellation (measured on
CPU/UCX: release of an in-flight WRITE succeeds and its DONE notice never arrives) to guarantee that
no more bytes land after the release returns.

Tensor parallelism: rank 0's WRITE is one of the group's (`group=True`): it carries no notification
and, even when NIXL reports it DONE, stays TRANSFERRING until `settle_group` says how the other ranks'
WRITEs ended; only then does it send the group's single DONE notice (everyone landed) or end FAILED
(with the ABORTED notice). A follower's WRITE (`announce=False`) never notifies anyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtransfer.base import TransferPlan, TransferState
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.roles import KVTransfer

log = logging.getLogger(__name__)


class NixlTransfer(KVTransfer):
    def __init__(
        self,
        agent: NixlAgent,
        peer: str,
        plan: TransferPlan,
        handle: Any,
        faults: FaultInjector,
        clock: Callable[[], float],
        *,
        group: bool = False,
        announce: bool = True,
    ) -> None:
        self.peer = peer
        self.num_bytes = plan.num_blocks * agent.handshake_info.bytes_per_block
        self._agent = agent
        self._plan = plan
        self._handle = handle
        self._faults = faults
        self._clock = clock
        self._state = TransferState.PENDING
        self._reason = ""
        self._stalled = False  # injected: never posted, looks in progress until the deadline
        self._stop: tuple[TransferState, str] | None = None  # requested end, pending NIXL's release
        self._announce = announce
        self._group_open = group  # DONE waits for settle_group (the other ranks' outcome)
        self._group_failure = ""
        self._group_notice: bytes | None = None  # sent once this WRITE and the group are DONE
        self.started_at = clock()
        self.finished_at: float | None = None

    @property
    def plan(self) -> TransferPlan:
        return self._plan

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def post(self) -> TransferState:
        """Post the WRITE (once, by the sender right after creating the transfer)."""
        assert self._state is TransferState.PENDING, "a transfer is posted once"
        self._state = TransferState.TRANSFERRING
        if self._faults.should_inject(Fault.STALL_TRANSFER):
            self._stalled = True
            return self.poll()
        if self._faults.should_inject(Fault.FAIL_TRANSFER):
            return self._advance("ERR", "injected fault: fail_transfer")
        try:
            status = self._agent.post(self._handle)
        except Exception as e:
            return self._advance("ERR", f"NIXL post failed: {e}")
        return self._advance(status, "NIXL reported a transfer error")

    def poll(self) -> TransferState:
        if self._state.is_terminal:
            return self._state
        if self._stalled:
            return self._advance("PROC", "")
        try:
            status = self._agent.status(self._handle)
        except Exception as e:
            return self._advance("ERR", f"NIXL status check failed: {e}")
        return self._advance(status, "NIXL reported a transfer error")

    def settle_group(self, failure: str, notice: bytes | None) -> TransferState:
        """The other ranks' WRITEs are terminal: `failure` empty means all DONE, and `notice` is then
        sent to the peer once this WRITE is DONE too; otherwise this transfer ends FAILED."""
        assert self._group_open, "settle_group is for a group's rank 0 transfer, once"
        self._group_open, self._group_failure, self._group_notice = False, failure, notice
        if failure and self._stop is None:
            self._stop = (TransferState.FAILED, failure)
        return self.poll()

    def cancel(self) -> TransferState:
        if not self._state.is_terminal and self._stop is None:
            self._stop = (TransferState.CANCELLED, "cancelled by its owner")
        return self.poll()

    def _advance(self, status: str, error: str) -> TransferState:
        if status == "DONE":
            if self._group_open:
                return self._state  # landed here; the other ranks have not said yet
            if self._stop is not None and self._stop[0] is TransferState.FAILED:
                return self._finish(*self._stop)  # another rank failed: the group did not land
            return self._finish(TransferState.DONE, "")
        if status == "ERR":
            return self._finish(TransferState.FAILED, error)
        if self._group_open:
            return self._state  # settle_group comes within this transfer's start(); its deadline after
        now = self._clock()
        if self._stop is None and now >= self._plan.deadline:
            waited = now - self.started_at
            self._stop = (TransferState.TIMED_OUT, f"deadline passed after {waited:.3f} s in flight")
        if self._stop is not None:
            return self._finish(*self._stop)
        return self._state

    def _finish(self, state: TransferState, reason: str) -> TransferState:
        if not self._agent.release(self._handle):
            return self._state  # NIXL still owns the blocks; retry on the next poll
        if state is TransferState.DONE and self._group_notice is not None:
            try:
                self._agent.send_notification(self.peer, self._group_notice)
            except Exception as e:  # the peer's deadline then fails it; tell it so if we still can
                state, reason = TransferState.FAILED, f"could not send the group's DONE notice: {e}"
        self._state, self._reason = state, reason
        self.finished_at = self._clock()
        if state is not TransferState.DONE and self._announce:
            self._notify_abort(reason)
        return state

    def _notify_abort(self, reason: str) -> None:
        notice = TransferNotice(
            NoticeKind.ABORTED,
            self._plan.request_id,
            self._plan.attempt,
            self._plan.num_blocks,
            reason=reason,
        )
        try:
            self._agent.send_notification(self.peer, notice.encode())
        except Exception as e:  # the peer may be gone; its own deadline and quarantine cover it
            log.warning("could not send abort notice for %s to %s: %s", self._plan.request_id, self.peer, e)
