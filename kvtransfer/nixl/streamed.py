"""One request's KV written in parts while its prompt is still being prefilled (`KVStream`).

    PENDING --write(part)--> TRANSFERRING --finish(plan), every part DONE--> DONE (+ the DONE notice)
                                  |-------- a part FAILED / TIMED_OUT ----> FAILED     (+ ABORTED)
                                  |-------- the deadline -----------------> TIMED_OUT  (+ ABORTED)
                                  '-------- cancel() ---------------------> CANCELLED  (+ ABORTED)

Each prefill chunk's newly full blocks go as a WRITE of their own (a `NixlTransfer` with no
notification) while the next chunk computes; `finish` posts the blocks that are left and sends the
one DONE notice for the whole plan, with its payload (checksums, first token). The receiver needs
nothing new: it expects every block of the plan and acts on the notice alone.

Ordering: NIXL does not order one WRITE's notice after another WRITE's bytes. So the notice rides on
the last WRITE only when every earlier part is already DONE when `finish` is called (the usual case:
a chunk's WRITE ends while the next chunk computes); otherwise it is sent on its own once every part
is DONE (one more poll).

Every end but DONE waits until NIXL has let go of every part (each part's handle released), and only
then sends the one ABORTED notice, so "no more bytes will land" holds on the receiver. A stream that
was never finished can never end DONE: its source blocks may be reused by their owner as soon as it
has asked to cancel (the destination is then never used, as no DONE notice can follow).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtransfer.base import TransferPlan, TransferState
from kvtransfer.errors import InvalidTransferPlanError
from kvtransfer.faults import FaultInjector
from kvtransfer.nixl.agent import NixlAgent
from kvtransfer.nixl.descriptors import block_indices
from kvtransfer.nixl.notification import NoticeKind, TransferNotice
from kvtransfer.nixl.transfer import NixlTransfer
from kvtransfer.roles import KVStream
from kvtransfer.stages import LayerSlice

log = logging.getLogger(__name__)


class StreamedTransfer(KVStream):
    def __init__(self, agent: NixlAgent, peer: str, request_id: str, attempt: int, deadline: float,
                 faults: FaultInjector, clock: Callable[[], float], layers: LayerSlice | None = None,
                 announce: bool = True) -> None:
        """`layers`: this rank's blocks land as that layer slice of the peer's (a pipeline stage into a
        decode worker of fewer stages). `announce=False`: rank 0's stream of a multi-rank worker
        (kvtransfer/nixl/staged_stream.py): it sends no notice at all, its owner does."""
        self.peer = peer
        self._agent = agent
        self._layers, self._announce = layers, announce
        self._request_id, self._attempt, self._deadline = request_id, attempt, deadline
        self._faults = faults
        self._clock = clock
        self._parts: list[NixlTransfer] = []
        self._written: dict[int, int] = {}  # remote block id -> local block id, of every posted part
        self._final: TransferPlan | None = None  # set by finish()
        self._notice: bytes | None = None  # DONE notice still to send once every part is DONE
        self._state = TransferState.PENDING
        self._reason = ""
        self._stop: tuple[TransferState, str] | None = None
        self.started_at = clock()
        self.finished_at: float | None = None

    # ---- what the owner reads -------------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def num_blocks(self) -> int:
        return len(self._written)

    @property
    def plan(self) -> TransferPlan:
        """The whole plan once finished; before, the blocks posted so far (raises if none was)."""
        if self._final is not None:
            return self._final
        if not self._written:
            raise InvalidTransferPlanError(f"stream {self._request_id!r} has written no block yet")
        remote = tuple(self._written)
        return TransferPlan(self._request_id, tuple(self._written[r] for r in remote), remote, self._deadline,
                            self._attempt)

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def is_finished(self) -> bool:
        return self._final is not None

    @property
    def moving(self) -> bool:
        if self._state.is_terminal:
            return False
        if self._stop is not None or self._notice is not None:
            return True
        return any(not p.state.is_terminal for p in self._parts)

    # ---- the owner's calls ------------------------------------------------------------------------
    def write(self, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> bool:
        """Post one part (no notice). False, posting nothing, once the stream is stopping, terminal or
        finished. Raises InvalidTransferPlanError for a malformed part (nothing posted)."""
        if self._stop is not None or self._state.is_terminal or self._final is not None:
            return False
        part = TransferPlan(self._request_id, tuple(local_block_ids), tuple(remote_block_ids), self._deadline,
                            self._attempt)
        again = [r for r in part.remote_block_ids if r in self._written]
        if again:
            raise InvalidTransferPlanError(f"stream {self._request_id!r}: remote blocks {again[:4]} written twice")
        self._post(part, b"")
        return True

    def finish(self, plan: TransferPlan) -> TransferState:
        """The prompt is prefilled: post what is left of `plan` (the whole hand-off, payload included)
        and have the DONE notice follow every part. Raises InvalidTransferPlanError (nothing posted)
        when `plan` disagrees with the parts already written."""
        if self._stop is not None or self._state.is_terminal:
            return self.poll()
        assert self._final is None, "a stream is finished once"
        pairs = dict(zip(plan.remote_block_ids, plan.local_block_ids, strict=True))
        wrong = [r for r, local in self._written.items() if pairs.get(r) != local]
        if wrong or plan.request_id != self._request_id or plan.attempt != self._attempt:
            raise InvalidTransferPlanError(f"stream {self._request_id!r}: the final plan disagrees with the "
                                           f"parts written (remote blocks {wrong[:4]})")
        self._final = plan
        self._deadline = plan.deadline  # the hand-off's own deadline from now (the parts keep theirs)
        notice = TransferNotice(NoticeKind.DONE, plan.request_id, plan.attempt, plan.num_blocks,
                                plan.payload).encode()
        rest = [i for i, r in enumerate(plan.remote_block_ids) if r not in self._written]
        # without a notice of its own, the stream is DONE once every part is
        earlier_done = all(p.state is TransferState.DONE for p in self._parts) or not self._announce
        notice = notice if self._announce else b""
        if rest:
            part = TransferPlan(plan.request_id, tuple(plan.local_block_ids[i] for i in rest),
                                tuple(plan.remote_block_ids[i] for i in rest), self._deadline, plan.attempt)
            self._post(part, notice if earlier_done else b"")
            self._notice = None if earlier_done else notice
        else:
            self._notice = notice or None
        return self.poll()

    def poll(self) -> TransferState:
        if self._state.is_terminal:
            return self._state
        for part in self._parts:
            part.poll()
        all_done = all(p.state is TransferState.DONE for p in self._parts)
        if self._final is not None and all_done and self._notice is None:
            return self._end(TransferState.DONE, "")  # the notice rode on the last part: it landed, so did all
        failed = next((p for p in self._parts if p.state.is_terminal and p.state is not TransferState.DONE), None)
        if self._stop is None and failed is not None:
            self._stop = (TransferState.FAILED, f"a part failed ({failed.state.value}): {failed.reason}")
        if self._stop is None and self._clock() >= self._deadline:
            self._stop = (TransferState.TIMED_OUT, f"deadline passed after {self._clock() - self.started_at:.3f} s")
        if self._stop is not None:
            return self._wind_down()
        if self._final is not None and all_done:
            return self._complete()
        if self._parts:
            self._state = TransferState.TRANSFERRING
        return self._state

    def cancel(self) -> TransferState:
        if not self._state.is_terminal and self._stop is None:
            self._stop = (TransferState.CANCELLED, "cancelled by its owner")
        return self.poll()

    # ---- inside ---------------------------------------------------------------------------------
    def _post(self, part: TransferPlan, notice: bytes) -> None:
        local = block_indices(part.local_block_ids, self._agent.num_blocks, "local")
        remote = block_indices(part.remote_block_ids, self._agent.peer(self.peer).info.num_blocks, "remote")
        handle = self._agent.make_write(self.peer, local, remote, notice, layers=self._layers)
        transfer = NixlTransfer(self._agent, self.peer, part, handle, self._faults, self._clock, announce=False)
        self._parts.append(transfer)
        self._written.update(zip(part.remote_block_ids, part.local_block_ids, strict=True))
        self._state = TransferState.TRANSFERRING
        transfer.post()

    def _wind_down(self) -> TransferState:
        """Stop every part; end once NIXL let go of all of them, then tell the peer."""
        assert self._stop is not None
        live = [p for p in self._parts if not p.state.is_terminal]
        for part in live:
            part.cancel()
        if any(not p.state.is_terminal for p in live):
            return self._state  # NIXL still owns some blocks: retry on the next poll
        return self._end(*self._stop)

    def _complete(self) -> TransferState:
        """Every part landed and the notice is still to go: send it alone."""
        assert self._notice is not None
        try:
            self._agent.send_notification(self.peer, self._notice)
        except Exception as e:  # the peer is gone: its deadline and quarantine cover it
            return self._end(TransferState.FAILED, f"could not send the DONE notice: {e}")
        self._notice = None
        return self._end(TransferState.DONE, "")

    def _end(self, state: TransferState, reason: str) -> TransferState:
        self._state, self._reason = state, reason
        self.finished_at = self._clock()
        if state is not TransferState.DONE and self._announce:
            self._notify_abort(reason)
        return state

    def _notify_abort(self, reason: str) -> None:
        notice = TransferNotice(NoticeKind.ABORTED, self._request_id, self._attempt, len(self._written),
                                reason=reason)
        try:
            self._agent.send_notification(self.peer, notice.encode())
        except Exception as e:  # the peer may be gone; its own deadline and quarantine cover it
            log.warning("could not send abort notice for %s to %s: %s", self._request_id, self.peer, e)
