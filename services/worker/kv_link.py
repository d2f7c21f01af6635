"""`KVLink`: one thread that owns this worker's KV transport (sender and receiver over one agent).

Why a thread of its own: someone must call into NIXL every few milliseconds for the worker's whole
life, even when idle (peers connect, notices arrive, abort notices go out). The engine thread is busy
with steps and the event loop must not poll in 50 us slices, so a dedicated thread does: it wakes at
once for a command (post a WRITE, expect an arrival), and otherwise polls every `poll_busy_s` while a
WRITE is in flight (an open KV stream only while one of its parts is: between parts it waits for the
next command, and a part waiting for its step's CUDA event is woken for by a `StepEventWaiter`), every
`poll_expect_s` while an arrival is expected, else every `poll_quiet_s` (each poll holds the GIL the
engine thread needs for its kernel launches, so a quiet link stays out of its way).
NIXL agents are not thread-safe (NIXL_THREAD_SYNC_NONE): every NIXL call happens on this thread.
asyncio callers cross in through a command queue and get asyncio futures back. The transport is
opened by name (`TransferConfig.transport`: `nixl`, or the in-process `memory` fake of the unit
tests; kvtransfer/transport.py), and only its KVSender / KVReceiver contract is used here.

What this thread never does (the hand-off under load was lost exactly there): device work or
synchronisation (checksums are computed and verified by the engines, kvtransfer/integrity.py), or
waiting on a lock the engine holds during a step. Its one CUDA call is a non-blocking query of the event
a streamed part waits for (the engine records it after the step that fills the part's blocks, and goes
on launching the next chunk instead of waiting for it). With NIXL's progress
thread on (the default on GPUs) UCX completes WRITEs and delivers notices without this thread, which
then only observes them.

Dangerous windows handled here:
- receiver: `release(rid, sender_idle=False)` of blocks whose WRITE may still land quarantines them;
  `on_reclaimable(rid)` fires (on the event loop) once the late notice arrives or the quarantine
  expires, and only then may the owner reuse the blocks;
- sender: a transfer's future resolves only once the transfer is terminal, i.e. NIXL has let go of
  the source blocks; the owner frees them only then.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.remote_commit import CommitOutcome, commit_failed
from kvtransfer.base import HandshakeInfo, LandedKV, TransferPlan, TransferState
from kvtransfer.faults import FaultInjector
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.roles import KVStream, KVTransfer
from kvtransfer.shards import KVShards
from kvtransfer.transport import open_transport
from services.worker.config import TransferConfig
from services.worker.link_commands import LinkCommands

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    """Sender side: how one WRITE ended (terminal: NIXL no longer reads the source blocks)."""

    request_id: str
    state: TransferState
    reason: str
    seconds: float
    num_bytes: int


@dataclass(frozen=True)
class Arrival:
    """Receiver side: DONE (landed, with the notice's payload; verified by the engine before use) or
    FAILED / TIMED_OUT with a reason."""

    request_id: str
    state: TransferState
    reason: str
    landed: LandedKV | None = None  # DONE only
    at: float = 0.0  # time.monotonic() when the link thread saw it
    # DONE with an `on_landed` hook (see KVLink.expect): how the hook's commit ended, and when; None
    # when no hook ran.
    commit: CommitOutcome | None = None
    committed_at: float = 0.0


# A DONE arrival's hook, called on the link thread: it must not block (e.g. it queues a command for
# the engine thread) and returns a future of the commit's outcome.
OnLanded = Callable[[LandedKV], "concurrent.futures.Future[CommitOutcome]"]


@dataclass
class _Send:
    """A WRITE this link posted, until its future resolves."""

    future: asyncio.Future[TransferResult]
    started_at: float  # time.monotonic() when the link thread posted it
    transfer: KVTransfer | None = None  # None until the sender accepted the plan


def _moving(send: _Send) -> bool:
    """A WRITE in flight (or being posted); an open KV stream only while a part of it is."""
    transfer = send.transfer
    return not isinstance(transfer, KVStream) or transfer.moving


class KVLink:
    def __init__(self, name: str, kv_cache: torch.Tensor, layout: KVLayoutInfo, config: TransferConfig,
                 faults: FaultInjector, on_reclaimable: Callable[[str], None], shards: KVShards | None = None) -> None:
        """`on_reclaimable(rid)` is called on the event loop that called `start()`. `shards`: the
        follower ranks of a tensor-parallel worker (this link is rank 0's; kvtransfer/nixl/shards.py);
        only this link's thread calls them (each call also holds the engine's next step back)."""
        self._config = config
        self._transport = open_transport(config.transport, name, kv_cache, layout,
                                         progress_thread=config.progress_thread, num_threads=config.nixl_threads,
                                         faults=faults, shards=shards, quarantine_s=config.quarantine_s)
        self._sender = self._transport.sender
        self._receiver = self._transport.receiver
        self._info = self._transport.handshake_info  # every rank's agent; immutable
        self._on_reclaimable = on_reclaimable
        self._wake = threading.Event()  # a command is queued (or a part's step completed): poll now
        self._commands = LinkCommands(self._wake.set)
        self._sends: dict[tuple[str, int], _Send] = {}  # posted, future not yet resolved
        self._expects: dict[str, asyncio.Future[Arrival]] = {}
        self._on_landed: dict[str, OnLanded] = {}
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="baton-kv-link", daemon=True)
        self._sliced_peers: dict[str, int] = {}  # decode peers of another TP size -> it (event loop only)
        self.num_inflight = 0  # WRITEs not yet terminal; read by status (a plain int: atomic under the GIL)

    @property
    def handshake_info(self) -> HandshakeInfo:
        return self._info  # immutable after creation: safe from any thread

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    # ---- asyncio API ----------------------------------------------------------------------------
    async def add_peer(self, info: HandshakeInfo) -> str:
        """Sender: check compatibility (IncompatiblePeerError), connect, prepare descriptors once."""
        name = str(await self._call(lambda: self._sender.add_peer(info)))
        if self._info.is_head_sliced(info):
            self._sliced_peers[name] = info.layout.tp_size
        return name

    def can_stream_to(self, peer: str) -> bool:
        """Per-chunk streaming: into a peer of the same TP size (kvtransfer/nixl/sliced.py); a multi-rank
        worker streams rank 0's blocks per chunk, the rest at the end (kvtransfer/nixl/staged_stream.py)."""
        return peer not in self._sliced_peers

    def head_slices(self, peer: str) -> int:
        """How many head slices each block goes to `peer` in (its TP size when it differs from ours, else 1):
        the prefill engine checksums each slice as that peer's rank will hold it."""
        return self._sliced_peers.get(peer, 1)

    async def accept_peer(self, info: HandshakeInfo) -> str:
        """Receiver: check a sender's compatibility (IncompatiblePeerError)."""
        return str(await self._call(lambda: self._receiver.accept_peer(info)))

    async def expect(self, request_id: str, block_ids: Sequence[int], deadline: float,
                     attempt: int, on_landed: OnLanded | None = None) -> asyncio.Future[Arrival]:
        """Receiver: register the blocks a WRITE will land in; the future resolves on arrival/failure.

        `on_landed`: called on this thread the moment the DONE notice is seen, so the decode engine
        can verify and commit the request at its next step boundary without a round trip through the
        event loop; the future then resolves once that commit is done, with its outcome."""
        assert self._loop is not None
        fut: asyncio.Future[Arrival] = self._loop.create_future()

        def register() -> None:
            self._receiver.expect(request_id, block_ids, deadline, attempt)
            self._expects[request_id] = fut
            if on_landed is not None:
                self._on_landed[request_id] = on_landed

        await self._call(register)
        return fut

    async def release(self, request_id: str, *, sender_idle: bool) -> bool:
        """Receiver: True when the blocks may be reused now; False: quarantined (see module doc)."""
        return bool(await self._call(lambda: self._release_now(request_id, sender_idle)))

    def release_safe(self, request_id: str, *, sender_idle: bool) -> None:
        """Receiver, event loop: `release` blocks the caller knows are safe (their DONE notice arrived, or
        the sender vouched over RPC that its WRITE is over: `sender_idle`), without waiting for this
        thread's answer, which would only repeat it. Queued like every command, so it runs before any
        later `expect`."""
        def release() -> None:
            if not self._release_now(request_id, sender_idle):
                log.error("%s: released as safe, yet the receiver quarantined its blocks", request_id)

        self._submit(release)

    def _release_now(self, request_id: str, sender_idle: bool) -> bool:
        """Link thread: forget the request's arrival and release its blocks (False: quarantined)."""
        self._expects.pop(request_id, None)
        self._on_landed.pop(request_id, None)
        return self._receiver.release(request_id, sender_idle=sender_idle)

    async def send(self, peer: str, plan: TransferPlan) -> asyncio.Future[TransferResult]:
        """Sender: post the WRITE; the future resolves once it is terminal."""
        assert self._loop is not None
        fut: asyncio.Future[TransferResult] = self._loop.create_future()

        def start() -> None:
            key = (plan.request_id, plan.attempt)
            send = _Send(fut, time.monotonic())
            self._sends[key] = send
            try:
                send.transfer = self._sender.start(peer, plan)
            except Exception:
                del self._sends[key]
                raise

        await self._call(start)
        return fut

    def open_stream(self, peer: str, request_id: str, attempt: int, deadline: float) -> asyncio.Future[TransferResult]:
        """Sender (event loop): open a per-chunk stream (kvtransfer KVStream); its parts are posted by
        `write_part`, its end by `finish_stream`; the future resolves once it is terminal, like `send`'s.
        Not awaited (no round trip before the prefill starts): the link thread opens it before any
        later command, and a stream it cannot open resolves FAILED at once (nothing was posted)."""
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[TransferResult] = loop.create_future()

        def open_() -> None:
            try:
                stream = self._sender.open_stream(peer, request_id, attempt, deadline)
            except Exception as e:  # noqa: BLE001 - the owner reads it as the stream's end
                failed = TransferResult(request_id, TransferState.FAILED, f"cannot open the KV stream: {e}", 0.0, 0)
                loop.call_soon_threadsafe(_settle, fut, failed, None)
                return
            self._sends[(request_id, attempt)] = _Send(fut, time.monotonic(), stream)

        self._submit(open_)
        return fut

    def write_part(self, request_id: str, attempt: int, local: tuple[int, ...], remote: tuple[int, ...],
                   ready: torch.cuda.Event | None = None) -> None:
        """Sender, from any thread (the engine's, right after the step that filled the blocks): post
        one part of an open stream once `ready` (the step's KV writes) has completed. A part the stream
        refuses stops the stream (it then fails)."""
        self._submit(lambda: self._on_stream(request_id, attempt, lambda s: s.write(local, remote)), ready)

    def finish_stream(self, plan: TransferPlan) -> None:
        """Sender, any thread: post the rest of the stream's plan and its DONE notice after every part."""
        self._submit(lambda: self._on_stream(plan.request_id, plan.attempt, lambda s: s.finish(plan)))

    def cancel(self, request_id: str, attempt: int) -> None:
        """Sender: ask NIXL to stop a WRITE; its future still resolves only once it is terminal."""
        self._submit(lambda: self._cancel_now(request_id, attempt))

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Cancel in-flight WRITEs, wait until they are terminal (bounded), then `close()`."""
        pending = [send.future for send in self._sends.values()]
        for rid, attempt in list(self._sends):
            self.cancel(rid, attempt)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        self.close(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and close NIXL. WRITEs still in flight are cancelled by the sender; their
        futures then read CANCELLED (the process is going away: nothing reuses their blocks)."""
        self._stop.set()
        self._wake.set()
        self._commands.close()
        if self._thread.ident is not None:  # started (a link that failed before start() has no thread)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("KV link thread did not stop in %.1f s; leaving NIXL open", timeout_s)
            return
        self._transport.close()
        self._resolve_sends()

    # ---- the link thread ------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        loop = self._loop

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        self._submit(run)
        return await fut

    def _submit(self, cmd: Callable[[], None], ready: torch.cuda.Event | None = None) -> None:
        """Queue `cmd` for the link thread, which runs the commands in order, each once its `ready` event
        (if any) has completed: a command behind a waiting one waits too, so a stream's DONE notice
        never passes its parts."""
        if self._stop.is_set():
            raise RuntimeError("the KV link is closed")
        self._commands.put(cmd, ready)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._commands.run_ready()
                self._poll_once()
            except Exception:  # one bad poll must not stop NIXL progress for every other request
                log.exception("KV link poll failed")
            self._wake.wait(self._interval())
            self._wake.clear()

    def _interval(self) -> float:
        if any(_moving(send) for send in self._sends.values()):
            return self._config.poll_busy_s
        if self._expects:
            return self._config.poll_expect_s
        return self._config.poll_quiet_s  # a part waiting for its step is woken for by the waiter

    def _poll_once(self) -> None:
        for transfer in self._sender.poll():
            self._finish_send(transfer)
        now = time.monotonic()
        for landed in self._receiver.poll_arrivals():
            self._resolve_expect(Arrival(landed.request_id, TransferState.DONE, "", landed, now))
        for rid, failure in self._receiver.poll_failures().items():
            self._resolve_expect(Arrival(rid, failure.state, failure.reason, at=now))
        reclaimable = self._receiver.poll_reclaimable()
        self.num_inflight = len(self._sends)
        if reclaimable and self._loop is not None:
            for rid in reclaimable:
                self._loop.call_soon_threadsafe(self._on_reclaimable, rid)

    def _finish_send(self, transfer: KVTransfer) -> None:
        send = self._sends.pop((transfer.request_id, transfer.attempt), None)
        if send is None or self._loop is None:
            return
        result = TransferResult(transfer.request_id, transfer.state, transfer.reason,
                                time.monotonic() - send.started_at, transfer.num_blocks * self._info.bytes_per_block)
        self._loop.call_soon_threadsafe(_settle, send.future, result, None)

    def _resolve_expect(self, arrival: Arrival) -> None:
        fut = self._expects.pop(arrival.request_id, None)
        hook = self._on_landed.pop(arrival.request_id, None)
        if fut is None or self._loop is None:
            return
        loop = self._loop
        if hook is None or arrival.landed is None:
            loop.call_soon_threadsafe(_settle, fut, arrival, None)
            return
        try:
            commit = hook(arrival.landed)
        except Exception as e:  # noqa: BLE001 - a broken hook must still resolve the arrival
            failed = dataclasses.replace(arrival, commit=commit_failed(e))
            loop.call_soon_threadsafe(_settle, fut, failed, None)
            return

        def committed(done: concurrent.futures.Future[CommitOutcome]) -> None:  # on the engine thread
            error = done.exception()
            outcome = dataclasses.replace(arrival, commit=commit_failed(error) if error is not None else done.result(),
                                          committed_at=time.monotonic())
            loop.call_soon_threadsafe(_settle, fut, outcome, None)

        commit.add_done_callback(committed)

    def _on_stream(self, request_id: str, attempt: int, act: Callable[[KVStream], object]) -> None:
        send = self._sends.get((request_id, attempt))
        if send is None or not isinstance(send.transfer, KVStream):
            return  # already terminal (cancelled, failed): nothing to post
        try:
            act(send.transfer)
        except Exception:  # a malformed part is a bug: the stream fails rather than lands wrong
            log.exception("stream of %s#%d refused a part; cancelling it", request_id, attempt)
            send.transfer.cancel()

    def _cancel_now(self, request_id: str, attempt: int) -> None:
        send = self._sends.get((request_id, attempt))
        if send is not None and send.transfer is not None:
            send.transfer.cancel()

    def _resolve_sends(self) -> None:
        """After the transport closed: every WRITE is cancelled (or the agent refused and we leak loudly)."""
        for (rid, _), send in list(self._sends.items()):
            if self._loop is not None and not self._loop.is_closed():
                result = TransferResult(rid, TransferState.CANCELLED, "worker shutting down", 0.0, 0)
                self._loop.call_soon_threadsafe(_settle, send.future, result, None)
        self._sends.clear()


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
