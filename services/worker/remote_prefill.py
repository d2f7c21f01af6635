"""Decode side: one attempt at having a prefill worker compute a prompt into this worker's blocks.

    expect(blocks) -> Prefill RPC -> response (first token, WRITE outcome) + NIXL DONE notice -> success
                                  \\-> error / outcome != DONE / checksum mismatch / no notice -> fallback

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
from typing import Any

import grpc

from engine.batch import TokenLogprobs
from engine.sampling_params import SamplingParams
from kvtransfer.base import TransferState
from services.rpc.convert import logprob_from_proto, outcome_from_proto, sampling_to_proto
from services.rpc.gen.baton.v1 import worker_pb2 as pb
from services.worker.config import TransferConfig
from services.worker.kv_link import Arrival, KVLink
from services.worker.prefill_peers import PrefillPeer, PrefillPeers

log = logging.getLogger(__name__)
KV_IDLE_TRAILER = "baton-kv-idle"  # set by the prefill worker once its WRITE is terminal
_ABORT_RPC_TIMEOUT_S = 2.0
# gRPC codes after which another prefill worker may succeed (this one is dead, slow or restarting).
_RETRY_ELSEWHERE = {
    grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "prefill_deadline",
    grpc.StatusCode.FAILED_PRECONDITION: "prefill_rejected",  # e.g. it restarted and lost our handshake
    grpc.StatusCode.RESOURCE_EXHAUSTED: "prefill_overloaded",
}
_OUTCOME_REASON = {
    TransferState.FAILED: "transfer_failed",
    TransferState.TIMED_OUT: "transfer_timeout",
    TransferState.CANCELLED: "transfer_aborted",
}


@dataclass(frozen=True)
class PrefillAsk:
    """What one attempt asks of a prefill worker (ids are this decode worker's)."""

    engine_request_id: str  # unique per attempt; the prefill worker's job id and the transfer's id
    attempt: int
    prompt: list[int]
    params: SamplingParams
    block_ids: tuple[int, ...]  # the whole block table from reserve_remote
    num_cached_tokens: int  # served by this worker's prefix cache: not transferred
    traceparent: str = ""  # forwarded as gRPC metadata (W3C trace context)


@dataclass(frozen=True)
class AttemptResult:
    first_token_id: int | None = None  # set on success
    first_logprobs: TokenLogprobs | None = None
    fallback: str = ""  # reason label (baton_pd_fallback_total) unless it succeeded or was aborted
    detail: str = ""
    blocks_safe: bool = True  # False: quarantined until the KV link reports them reclaimable
    retry_elsewhere: bool = False  # another prefill worker may succeed
    aborted: bool = False

    @property
    def ok(self) -> bool:
        return self.first_token_id is not None


@dataclass(frozen=True)
class _CallEnd:
    response: pb.PrefillResponse | None
    code: grpc.StatusCode
    details: str
    idle: bool  # the prefill worker vouched that nothing more will land


class RemotePrefill:
    def __init__(self, link: KVLink, peers: PrefillPeers, config: TransferConfig, block_size: int) -> None:
        self._link = link
        self._peers = peers
        self._config = config
        self._block_size = block_size

    async def run(self, ask: PrefillAsk, peer: PrefillPeer, aborted: asyncio.Event) -> AttemptResult:
        """One attempt, to a definite end (see the module docstring for when blocks are safe).

        Never raises: a bug inside reads as fallback "internal_error" with the blocks' real safety."""
        bs, n = self._block_size, len(ask.prompt)
        remote_ids = ask.block_ids[ask.num_cached_tokens // bs:-(-n // bs)]
        deadline = time.monotonic() + self._config.prefill_timeout_s + self._config.notice_grace_s
        try:
            arrival = await self._link.expect(ask.engine_request_id, remote_ids, deadline, ask.attempt)
        except Exception as e:  # nothing registered, nothing asked: the blocks are ours
            log.exception("%s: cannot expect a transfer", ask.engine_request_id)
            return AttemptResult(fallback="internal_error", detail=str(e))
        asked = time.monotonic()
        rpc = asyncio.ensure_future(self._call(peer, ask, remote_ids))
        peer.inflight += 1
        end: _CallEnd | None = None
        try:
            end = await self._until_rpc_end(peer, ask, rpc, aborted)
            answered = time.monotonic()
            result = AttemptResult(aborted=True) if aborted.is_set() else await self._judge(peer, end, arrival, aborted)
            _log_phases(ask.engine_request_id, end, answered - asked, time.monotonic() - answered)
        except Exception as e:
            log.exception("%s: remote prefill attempt failed", ask.engine_request_id)
            result = AttemptResult(fallback="internal_error", detail=str(e))
        finally:
            peer.inflight -= 1
            safe = await self._link.release(ask.engine_request_id, sender_idle=end is not None and end.idle)
        if not safe:
            log.warning("%s: blocks quarantined (no definite end of the WRITE)", ask.engine_request_id)
        return replace(result, blocks_safe=safe)

    async def _until_rpc_end(self, peer: PrefillPeer, ask: PrefillAsk, rpc: asyncio.Future[_CallEnd],
                             aborted: asyncio.Event) -> _CallEnd:
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(_futures(rpc, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not rpc.done():  # aborted: ask the prefill worker to stop, then wait for its answer
            with contextlib.suppress(grpc.aio.AioRpcError):
                await peer.stub.Abort(pb.AbortRequest(request_id=ask.engine_request_id),
                                      timeout=_ABORT_RPC_TIMEOUT_S)
        return await rpc

    async def _judge(self, peer: PrefillPeer, end: _CallEnd, arrival: asyncio.Future[Arrival],
                     aborted: asyncio.Event) -> AttemptResult:
        if end.response is None:
            label = _RETRY_ELSEWHERE.get(end.code)
            if label is not None:
                self._peers.mark_down(peer, f"{end.code.name}: {end.details}")
                return AttemptResult(fallback=label, detail=end.details, retry_elsewhere=True)
            return AttemptResult(fallback="prefill_error", detail=f"{end.code.name}: {end.details}")
        response = end.response
        state = outcome_from_proto(response.outcome)
        if state is not TransferState.DONE:
            return AttemptResult(fallback=_OUTCOME_REASON[state], detail=response.reason)
        landed = await self._wait_arrival(arrival, aborted)
        if aborted.is_set():
            return AttemptResult(aborted=True)
        if landed is None or landed.state is TransferState.TIMED_OUT:
            return AttemptResult(fallback="transfer_timeout", detail="no NIXL notice after a DONE response")
        if landed.state is not TransferState.DONE:
            label = "checksum_mismatch" if "checksum" in landed.reason else "transfer_failed"
            return AttemptResult(fallback=label, detail=landed.reason)
        logprobs = logprob_from_proto(response.first_logprob) if response.HasField("first_logprob") else None
        return AttemptResult(first_token_id=response.first_token_id, first_logprobs=logprobs)

    async def _wait_arrival(self, arrival: asyncio.Future[Arrival], aborted: asyncio.Event) -> Arrival | None:
        """The notice follows the bytes; after a DONE response it is at most `notice_grace_s` away."""
        waiter = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait(_futures(arrival, waiter), timeout=self._config.notice_grace_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return arrival.result() if arrival.done() else None

    async def _call(self, peer: PrefillPeer, ask: PrefillAsk, remote_ids: tuple[int, ...]) -> _CallEnd:
        request = pb.PrefillRequest(
            request_id=ask.engine_request_id,
            prompt_token_ids=ask.prompt,
            sampling=sampling_to_proto(ask.params),
            decode_agent=self._link.handshake_info.agent_name,
            remote_block_ids=list(remote_ids),
            num_cached_tokens=ask.num_cached_tokens,
            attempt=ask.attempt,
            transfer_timeout_s=self._config.transfer_timeout_s,
        )
        metadata = (("traceparent", ask.traceparent),) if ask.traceparent else None
        call = peer.stub.Prefill(request, timeout=self._config.prefill_timeout_s, metadata=metadata)
        try:
            response = await call
        except grpc.aio.AioRpcError as e:
            return _CallEnd(None, e.code(), e.details() or "", _idle(e.trailing_metadata()))
        return _CallEnd(response, grpc.StatusCode.OK, "", _idle(await call.trailing_metadata()))


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
