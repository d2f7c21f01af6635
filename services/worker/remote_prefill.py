"""Decode side: one attempt at having a prefill worker compute a prompt into this worker's blocks.

    expect(blocks) -> Prefill RPC ... NIXL DONE notice (first token + checksums) -> landed: success
                                  \\-> RPC error / outcome != DONE / ABORTED notice / no notice -> fallback

Success is decided by the DONE notice alone, the moment the KV link sees it: NIXL delivers it only
once every block is visible here, and it carries the first token. With an `on_landed` hook the KV
link thread hands the landed KV straight to the engine thread, which verifies the checksums
(kvtransfer.integrity) and commits at its next step boundary; the attempt then reports the commit's
outcome. Nobody waits for the Prefill RPC's answer (the prefill worker sends it only after its WRITE
turned terminal, so it trails the notice; it is still awaited in the background).

Dangerous window: from `expect` until the WRITE is known to be over, the prefill worker may write
into the blocks at any moment. It is known to be over when the Prefill RPC ended with the
`baton-kv-idle` trailer (the prefill worker answers only after its WRITE is terminal) or when the
NIXL DONE/ABORTED notice arrived. Without either (prefill worker dead, RPC deadline), `release`
quarantines the blocks and `AttemptResult.blocks_safe` is False: the caller must keep them allocated
until the KV link reports them reclaimable. An abort in this phase asks the prefill worker to stop
(Abort RPC) and then still waits for the Prefill RPC to end, so the blocks are normally safe at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import grpc

from engine.batch import TokenLogprobs
from engine.remote_commit import CommitOutcome
from engine.sampling_params import SamplingParams
from kvtransfer.base import LandedKV, TransferState
from rpcgen.baton.v1 import worker_pb2 as pb
from services.rpc.convert import outcome_from_proto
from services.worker.config import TransferConfig
from services.worker.kv_link import Arrival, KVLink, OnLanded
from services.worker.prefill_order import PrefillDestination, PrefillOrder
from services.worker.prefill_peers import PrefillPeer, PrefillPeers

log = logging.getLogger(__name__)
KV_IDLE_TRAILER = "baton-kv-idle"  # set by the prefill worker once its WRITE is terminal
_ABORT_RPC_TIMEOUT_S = 2.0


class FallbackReason(StrEnum):
    """Why a remote prefill did not hand its KV over (`baton_pd_fallback_total{reason}`)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    HANDSHAKE_REFUSED = "handshake_refused"
    PREFILL_UNAVAILABLE = "prefill_unavailable"
    PREFILL_DEADLINE = "prefill_deadline"
    PREFILL_REJECTED = "prefill_rejected"
    PREFILL_OVERLOADED = "prefill_overloaded"
    PREFILL_ERROR = "prefill_error"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_TIMEOUT = "transfer_timeout"
    TRANSFER_ABORTED = "transfer_aborted"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    INTERNAL_ERROR = "internal_error"
    DECODE_OUT_OF_BLOCKS = "decode_out_of_blocks"  # no blocks to reserve: prefilled locally at once


# gRPC codes after which another prefill worker may succeed (this one is dead, slow or restarting).
_RETRY_ELSEWHERE = {
    grpc.StatusCode.UNAVAILABLE: FallbackReason.PREFILL_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: FallbackReason.PREFILL_DEADLINE,
    grpc.StatusCode.FAILED_PRECONDITION: FallbackReason.PREFILL_REJECTED,  # e.g. it restarted: lost our handshake
    grpc.StatusCode.RESOURCE_EXHAUSTED: FallbackReason.PREFILL_OVERLOADED,
}
_OUTCOME_REASON = {
    TransferState.FAILED: FallbackReason.TRANSFER_FAILED,
    TransferState.TIMED_OUT: FallbackReason.TRANSFER_TIMEOUT,
    TransferState.CANCELLED: FallbackReason.TRANSFER_ABORTED,
}


@dataclass(frozen=True)
class AttemptResult:
    landed: LandedKV | None = None  # set on success: every block is here (checksums not yet verified)
    first_token_id: int | None = None  # set on success (from the DONE notice)
    first_logprobs: TokenLogprobs | None = None
    noticed_at: float = 0.0  # time.monotonic() when the KV link saw the DONE notice
    notice_wait_s: float = 0.0  # Prefill RPC sent -> DONE notice seen
    # With an `on_landed` hook: how its commit ended (None if it did not run); unless committed, the
    # caller still owns the blocks.
    commit: CommitOutcome | None = None
    committed_at: float = 0.0
    fallback: FallbackReason | None = None  # set unless it succeeded or was aborted
    detail: str = ""
    blocks_safe: bool = True  # False: quarantined until the KV link reports them reclaimable
    retry_elsewhere: bool = False  # another prefill worker may succeed
    aborted: bool = False

    @property
    def ok(self) -> bool:
        return self.landed is not None and self.first_token_id is not None


@dataclass(frozen=True)
class _CallEnd:
    response: pb.PrefillResponse | None
    code: grpc.StatusCode
    details: str
    idle: bool  # the prefill worker vouched that nothing more will land


# A Prefill RPC in flight (`RemotePrefill.ask`): resolves with how the call ended.
AskedPrefill = asyncio.Future[_CallEnd]


class RemotePrefill:
    def __init__(self, link: KVLink, peers: PrefillPeers, config: TransferConfig, block_size: int) -> None:
        self._link = link
        self._peers = peers
        self._config = config
        self._block_size = block_size
        self._trailing: set[asyncio.Future[_CallEnd]] = set()  # answered after their KV landed

    def early_order(self, request_id: str, attempt: int, prompt: list[int], params: SamplingParams,
                    traceparent: str = "", choice_params: tuple[SamplingParams, ...] = ()) -> PrefillOrder:
        """An order sent before this worker reserved: its blocks follow (`run(..., asked=...)`)."""
        return PrefillOrder(request_id, attempt, prompt, params, (), 0, self._link.handshake_info.agent_name,
                            self._config.transfer_timeout_s, traceparent, choice_params, destination_follows=True)

    def order(self, request_id: str, attempt: int, prompt: list[int], params: SamplingParams,
              block_table: tuple[int, ...], num_cached_tokens: int, traceparent: str = "",
              choice_params: tuple[SamplingParams, ...] = ()) -> PrefillOrder:
        """What this worker asks of a prefill worker for a reservation (`block_table` from
        `reserve_remote`): its blocks for the uncached prompt tokens, its KV agent, the WRITE's deadline,
        and (n > 1) the other choices' settings for their first tokens."""
        bs, n = self._block_size, len(prompt)
        return PrefillOrder(request_id, attempt, prompt, params, block_table[num_cached_tokens // bs:-(-n // bs)],
                            num_cached_tokens, self._link.handshake_info.agent_name,
                            self._config.transfer_timeout_s, traceparent, choice_params)

    def ask_early(self, peer: PrefillPeer, request_id: str, attempt: int, prompt: list[int], params: SamplingParams,
                  traceparent: str = "", choice_params: tuple[SamplingParams, ...] = ()) -> AskedPrefill | None:
        """With `overlap_reserve`: send the Prefill RPC before this worker reserved its blocks; they
        follow in `run(..., asked=...)`. None without it (the RPC goes from `run`)."""
        if not self._config.overlap_reserve:
            return None
        return self.ask(self.early_order(request_id, attempt, prompt, params, traceparent, choice_params), peer)

    def ask(self, order: PrefillOrder, peer: PrefillPeer) -> AskedPrefill:
        """Send the Prefill RPC now; for a `destination_follows` order, before this worker reserved
        (the prefill worker computes meanwhile, and writes nothing before `run` sends the destination)."""
        rpc = asyncio.ensure_future(self._call(peer, order))
        peer.inflight += 1
        rpc.add_done_callback(lambda _: _leave(peer))
        return rpc

    def withdraw(self, peer: PrefillPeer, request_id: str, rpc: AskedPrefill) -> None:
        """Stop an asked prefill that never got a destination: nothing can land here, so nobody waits."""
        self._trail(rpc, request_id)
        asyncio.ensure_future(_abort_quietly(peer, request_id))

    async def run(self, order: PrefillOrder, peer: PrefillPeer, aborted: asyncio.Event,
                  on_landed: OnLanded | None = None, asked: AskedPrefill | None = None) -> AttemptResult:
        """One attempt, to a definite end (see the module docstring for when blocks are safe).
        `asked`: the Prefill RPC already sent with its destination to follow (`ask`): after `expect`,
        the destination goes in a PrefillDestination call.

        Never raises: a bug inside reads as fallback INTERNAL_ERROR with the blocks' real safety."""
        deadline = time.monotonic() + self._config.prefill_timeout_s + self._config.notice_grace_s
        try:
            arrival = await self._link.expect(order.request_id, order.remote_block_ids, deadline, order.attempt,
                                              on_landed)
        except Exception as e:  # nothing registered, nothing asked: the blocks are ours
            log.exception("%s: cannot expect a transfer", order.request_id)
            if asked is not None:
                self.withdraw(peer, order.request_id, asked)
            return AttemptResult(fallback=FallbackReason.INTERNAL_ERROR, detail=str(e))
        sent_at = time.monotonic()
        if asked is None:
            rpc = self.ask(order, peer)
        else:
            rpc = asked
            asyncio.ensure_future(_send_destination(peer, order))
        end: _CallEnd | None = None
        result: AttemptResult | None = None
        try:
            if await _landed_first(arrival, rpc, aborted):
                result = _landed(arrival.result(), sent_at)
                self._trail(rpc, order.request_id)  # its answer follows; the WRITE is over already
            else:
                end = await self._until_rpc_end(peer, order, rpc, aborted)
                answered = time.monotonic()
                result = (AttemptResult(aborted=True) if aborted.is_set()
                          else await self._judge(peer, end, arrival, aborted, sent_at))
                _log_phases(order.request_id, end, answered - sent_at, time.monotonic() - answered)
        except Exception as e:
            log.exception("%s: remote prefill attempt failed", order.request_id)
            result = AttemptResult(fallback=FallbackReason.INTERNAL_ERROR, detail=str(e))
        finally:
            sender_idle = end is not None and end.idle
            landed = result is not None and result.landed is not None
            safe = await self._release(order.request_id, sender_idle or landed, sender_idle)
        assert result is not None  # set on every path that gets here
        if not safe:
            log.warning("%s: blocks quarantined (no definite end of the WRITE)", order.request_id)
        return replace(result, blocks_safe=safe)

    async def _release(self, request_id: str, known_safe: bool, sender_idle: bool) -> bool:
        """Whether the attempt's blocks are safe to reuse. Known safe (the DONE notice landed them, or the
        prefill worker vouched its WRITE is over): released without a round trip to the link thread,
        which the first token (already in the engine's stream, published by the commit) would wait for."""
        if known_safe:
            self._link.release_safe(request_id, sender_idle=sender_idle)
            return True
        return await self._link.release(request_id, sender_idle=sender_idle)

    def _trail(self, rpc: asyncio.Future[_CallEnd], request_id: str) -> None:
        """Keep the Prefill RPC whose KV already landed until it answers (its outcome no longer matters)."""
        self._trailing.add(rpc)

        def done(fut: asyncio.Future[_CallEnd]) -> None:
            self._trailing.discard(fut)
            if not fut.cancelled() and fut.exception() is None and fut.result().response is None:
                log.info("%s: KV landed, then the Prefill RPC ended %s", request_id, fut.result().code.name)

        rpc.add_done_callback(done)

    async def _until_rpc_end(self, peer: PrefillPeer, order: PrefillOrder, rpc: asyncio.Future[_CallEnd],
                             aborted: asyncio.Event) -> _CallEnd:
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(_futures(rpc, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not rpc.done():  # aborted: ask the prefill worker to stop, then wait for its answer
            with contextlib.suppress(grpc.aio.AioRpcError):
                await peer.stub.Abort(pb.AbortRequest(request_id=order.request_id),
                                      timeout=_ABORT_RPC_TIMEOUT_S)
        return await rpc

    async def _judge(self, peer: PrefillPeer, end: _CallEnd, arrival: asyncio.Future[Arrival],
                     aborted: asyncio.Event, asked: float) -> AttemptResult:
        if end.response is None:
            label = _RETRY_ELSEWHERE.get(end.code)
            if label is not None:
                self._peers.mark_down(peer, f"{end.code.name}: {end.details}")
                return AttemptResult(fallback=label, detail=end.details, retry_elsewhere=True)
            return AttemptResult(fallback=FallbackReason.PREFILL_ERROR, detail=f"{end.code.name}: {end.details}")
        response = end.response
        state = outcome_from_proto(response.outcome)
        if state is not TransferState.DONE:
            return AttemptResult(fallback=_OUTCOME_REASON[state], detail=response.reason)
        landed = await self._wait_arrival(arrival, aborted)
        if aborted.is_set():
            return AttemptResult(aborted=True)
        if landed is None or landed.state is TransferState.TIMED_OUT:
            return AttemptResult(fallback=FallbackReason.TRANSFER_TIMEOUT,
                                 detail="no NIXL notice after a DONE response")
        if landed.state is not TransferState.DONE:
            return AttemptResult(fallback=FallbackReason.TRANSFER_FAILED, detail=landed.reason)
        return _landed(landed, asked)

    async def _wait_arrival(self, arrival: asyncio.Future[Arrival], aborted: asyncio.Event) -> Arrival | None:
        """The notice follows the bytes; after a DONE response it is at most `notice_grace_s` away."""
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(_futures(arrival, waiter), timeout=self._config.notice_grace_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return arrival.result() if arrival.done() else None

    async def _call(self, peer: PrefillPeer, order: PrefillOrder) -> _CallEnd:
        request = order.to_proto()
        metadata = (("traceparent", order.traceparent),) if order.traceparent else None
        call = peer.stub.Prefill(request, timeout=self._config.prefill_timeout_s, metadata=metadata)
        try:
            response = await call
        except grpc.aio.AioRpcError as e:
            return _CallEnd(None, e.code(), e.details() or "", _idle(e.trailing_metadata()))
        return _CallEnd(response, grpc.StatusCode.OK, "", _idle(await call.trailing_metadata()))


async def _landed_first(arrival: asyncio.Future[Arrival], rpc: asyncio.Future[_CallEnd],
                        aborted: asyncio.Event) -> bool:
    """Wait for the first of: the arrival, the RPC's end, an abort. True: the KV landed first."""
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait(_futures(arrival, rpc, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    return (arrival.done() and not aborted.is_set() and arrival.exception() is None
            and arrival.result().state is TransferState.DONE)


def _landed(arrival: Arrival, asked: float) -> AttemptResult:
    assert arrival.landed is not None
    payload = arrival.landed.payload
    return AttemptResult(landed=arrival.landed, first_token_id=payload.first_token_id,
                         first_logprobs=payload.first_logprobs, noticed_at=arrival.at,
                         notice_wait_s=max(arrival.at - asked, 0.0), commit=arrival.commit,
                         committed_at=arrival.committed_at)


async def _send_destination(peer: PrefillPeer, order: PrefillOrder) -> None:
    """Tell an asked prefill where to write. A refusal needs no action here: the Prefill RPC then ends
    with why (or the prefill worker fails the WRITE for want of a destination) and the attempt falls back."""
    destination = PrefillDestination(order.request_id, order.attempt, order.remote_block_ids, order.num_cached_tokens)
    try:
        reply = await peer.stub.PrefillDestination(destination.to_proto(), timeout=_ABORT_RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.warning("%s: PrefillDestination failed: %s %s", order.request_id, e.code().name, e.details())
        return
    if not reply.accepted:
        log.warning("%s: the prefill worker refused its destination: %s", order.request_id, reply.reason)


async def _abort_quietly(peer: PrefillPeer, request_id: str) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        await peer.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=_ABORT_RPC_TIMEOUT_S)


def _leave(peer: PrefillPeer) -> None:
    peer.inflight -= 1


def _log_phases(request_id: str, end: _CallEnd, rpc_s: float, notice_s: float) -> None:
    """Where a hand-off's time went (DEBUG): the Prefill RPC as seen here, the prefill worker's own
    queue + prefill and WRITE times inside it, then the wait for the NIXL notice (and checksums)."""
    if end.response is not None and log.isEnabledFor(logging.DEBUG):
        r = end.response
        log.debug("%s hand-off: rpc %.1f ms (prefill %.1f ms, write %.1f ms on the prefill worker), notice %.1f ms",
                  request_id, rpc_s * 1e3, r.prefill_seconds * 1e3, r.transfer_seconds * 1e3, notice_s * 1e3)


def _idle(metadata: object) -> bool:
    return any(k == KV_IDLE_TRAILER and v == "1" for k, v in (metadata or ()))  # type: ignore[attr-defined]


def _futures(*futures: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
    """A set of differently typed futures for asyncio.wait."""
    return set(futures)
