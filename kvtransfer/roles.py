"""The KV hand-off's roles, split like vLLM's NIXL connector: the prefill side *writes* its local blocks
into the decode side's blocks (one-sided WRITE + a notification); the decode side only *exposes* its
blocks and learns from the notification that a request's KV has arrived. Every transfer is an explicit
state machine (SGLang's lesson), polled by its owner; nothing here blocks or spawns threads.
The data these interfaces exchange is in kvtransfer/base.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtransfer.base import HandshakeInfo, LandedKV, TransferFailure, TransferPlan, TransferState


class KVTransfer(ABC):
    """Sender-side handle of one request's WRITE; a state machine advanced only by `poll()`.

    PENDING -> TRANSFERRING -> DONE | FAILED | TIMED_OUT | CANCELLED. Once terminal, NIXL no longer
    reads the source blocks and the NIXL handle is released: the caller may free the source blocks.
    Before that they must stay allocated and unmodified, even after `cancel()`.
    """

    @property
    @abstractmethod
    def plan(self) -> TransferPlan: ...

    @property
    @abstractmethod
    def state(self) -> TransferState: ...

    @property
    @abstractmethod
    def reason(self) -> str:
        """Empty unless FAILED / TIMED_OUT / CANCELLED; then a human-readable cause."""

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def attempt(self) -> int:
        return self.plan.attempt

    @property
    def num_blocks(self) -> int:
        """Blocks this transfer has posted (its whole plan, for a one-shot WRITE)."""
        return self.plan.num_blocks

    @abstractmethod
    def poll(self) -> TransferState:
        """Advance the state machine without blocking; enforce the deadline; return the state."""

    @abstractmethod
    def cancel(self) -> TransferState:
        """Ask to stop. The state turns CANCELLED only once NIXL has let go of the blocks, which may
        take further `poll()` calls: an abort that lands while a WRITE is in flight must wait for the
        transfer to finish (or be cancelled by NIXL) before the blocks are reused. It may still end
        DONE if the WRITE completed first (then the peer got its DONE notice, too)."""


class KVStream(KVTransfer):
    """Sender-side handle of one request's KV streamed per prefill chunk (kvtransfer/nixl/streamed.py).

    `write()` posts a chunk's newly full blocks (no notice) while the next chunk computes; `finish()`
    takes the whole plan, posts what is left and sends the one DONE notice after every part landed.
    Until `finish()`, `plan` lists only the blocks posted so far. A stream that is never finished
    never ends DONE, so once it is cancelled its source blocks may be reused at once (nothing the
    peer could use will land); a finished one keeps them until it is terminal, like any KVTransfer.
    """

    @abstractmethod
    def write(self, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> bool:
        """Post one part; False (nothing posted) once stopping, terminal or finished."""

    @abstractmethod
    def finish(self, plan: TransferPlan) -> TransferState:
        """Post the rest of `plan` and have its DONE notice follow every part."""

    @property
    @abstractmethod
    def moving(self) -> bool:
        """Whether polling soon advances it: a part posted and not yet terminal, a notice still to send,
        or a stop winding down. False while an open stream waits for its next part (its owner then
        need not poll it at a WRITE's rate: that polling took the GIL from the engine thread at 20 kHz
        for the whole prefill)."""


class KVSender(ABC):
    """Prefill side: writes local blocks into a peer's blocks (WRITE + notification).

    Threading: not thread-safe. One thread (the worker's transfer loop) makes every call on a sender,
    including `poll()`, which must run every few milliseconds for the sender's whole life: it
    advances in-flight transfers and, even when none is in flight, completes the sending of abort
    notices (with NIXL's progress thread off nothing else moves them).
    Lifetimes: a peer lives from `add_peer` to `remove_peer`/`close`; a transfer's source blocks must
    stay allocated and unmodified until the transfer is terminal. The caller must have finished
    writing the source blocks (on CUDA: the step that wrote them has been read back) before `start()`.
    A sender never runs device work: the plan's payload arrives computed.
    """

    @property
    @abstractmethod
    def handshake_info(self) -> HandshakeInfo: ...

    @abstractmethod
    def add_peer(self, info: HandshakeInfo) -> str:
        """Check compatibility (raises IncompatiblePeerError), connect, prepare the peer's descriptor
        list once; return the peer name. Re-adding the same peer with the same metadata is a no-op."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer. Raises PeerBusyError while transfers to it are not terminal."""

    @abstractmethod
    def start(self, peer: str, plan: TransferPlan) -> KVTransfer:
        """Post the WRITE of `plan` to `peer` and return its handle (already TRANSFERRING or terminal).
        Raises InvalidTransferPlanError / UnknownPeerError / TransferSetupError before touching a block."""

    @abstractmethod
    def open_stream(self, peer: str, request_id: str, attempt: int, deadline: float) -> KVStream:
        """Open a per-chunk stream to `peer` (nothing posted yet); tracked and polled like `start`'s
        transfers from now on. Raises UnknownPeerError, or TransferSetupError where this sender cannot
        stream (then the caller sends the whole plan with `start`)."""

    @abstractmethod
    def poll(self) -> list[KVTransfer]:
        """Poll every in-flight transfer; return (and stop tracking) those that turned terminal.
        Every started transfer is returned exactly once, also one already terminal inside start()."""

    @abstractmethod
    def close(self) -> None:
        """Cancel in-flight transfers, wait (bounded) for NIXL to let go, remove every peer."""


class KVReceiver(ABC):
    """Decode side: exposes its blocks, detects a request's KV arrival by its notification.

    Threading: not thread-safe; one thread polls. With NIXL's progress thread off (our default)
    the receiver must be polled every few milliseconds for as long as any peer may connect or write —
    even when no arrival is expected — or the peer's WRITE never completes.
    Lifetimes: the blocks passed to `expect()` belong to the transfer until `release()` returns True or
    the request appears in `poll_reclaimable()`. A WRITE may land in them at any time before the
    request's notification (DONE or ABORTED) arrives, so an abort that lands while a WRITE is in flight
    must wait for the transfer to finish before the blocks are reused.
    """

    @property
    @abstractmethod
    def handshake_info(self) -> HandshakeInfo: ...

    @abstractmethod
    def accept_peer(self, info: HandshakeInfo) -> str:
        """Check a sender's compatibility (raises IncompatiblePeerError); return its name."""

    @abstractmethod
    def expect(self, request_id: str, block_ids: Sequence[int], deadline: float, attempt: int = 0) -> None:
        """Register that `block_ids` will receive `request_id`'s KV before `deadline` (receiver clock).
        Must precede asking the sender to write, and list the ids in the order the sender's plan lists
        its `remote_block_ids` (checksums are per position). Give the receiver a later deadline than
        the sender's, so that the sender's abort notice normally arrives first."""

    @abstractmethod
    def poll_arrivals(self) -> list[LandedKV]:
        """Drain notifications; return the requests whose KV landed since the last call (DONE notices
        of expected attempts with the right block count; integrity is the owner's to verify)."""

    @abstractmethod
    def poll_failures(self) -> dict[str, TransferFailure]:
        """Drain notifications; return requests that turned FAILED or TIMED_OUT since last call."""

    @abstractmethod
    def state(self, request_id: str) -> TransferState | None:
        """State of an expected (not yet released) request, None if unknown."""

    @abstractmethod
    def release(self, request_id: str, *, sender_idle: bool = False) -> bool:
        """Stop tracking `request_id`. True: its blocks may be reused now. False: a WRITE may still land
        in them; they are quarantined until its notification arrives or the quarantine expires, and the
        request then appears (once) in `poll_reclaimable()`. Pass `sender_idle=True` when the sender
        reported (over RPC) that its transfer is terminal or never started: the blocks are then free at
        once, also if already quarantined (which then ends without a `poll_reclaimable` report)."""

    @abstractmethod
    def poll_reclaimable(self) -> set[str]:
        """Request ids whose quarantined blocks became safe to reuse since last call."""

    @abstractmethod
    def close(self) -> None:
        """Stop tracking everything. Only safe once no peer can still write (see `release`)."""
