"""Decode side (and the co-located `both` role): one Generate request from admission to its last token.

Each request is a flow, run as a task of its own that feeds the caller's stream through a queue, so
a caller that goes away (client cancellation) only *asks* the flow to abort and can never skip its
cleanup. Phases and how an abort lands in each:

    prefill (remote attempt(s) via RemotePrefill, or local) -> in the engine (queued / decoding)

- remote attempt: RemotePrefill stops the prefill worker (Abort RPC) and waits for the definite end
  of its WRITE; the attempt's blocks are then freed, or kept under quarantine until the KV link
  reports them reclaimable (`on_reclaimable`), never reused while a WRITE may land;
- in the engine: `AsyncEngine.abort` frees the blocks and ends the stream with an ABORT output.

A failed remote prefill falls back (another prefill worker if this one looks dead or slow, else a
local recompute), counted in `baton_pd_fallback_total{reason}` and logged with the request id. A
checksum mismatch also recomputes locally: the landed blocks are verified on the engine thread in the
same pass between steps that commits them, so corrupted blocks are never committed, garbage is never
decoded, and the caller still gets the right tokens.

Engine request ids are `<request id>@<attempt>`: an attempt whose blocks are quarantined keeps its
own id in the engine while the retry runs under the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from engine.async_engine import ABORTED_BEFORE_COMMIT, AsyncEngine, Reservation
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.base import LandedKV
from kvtransfer.integrity import LandedVerifier
from services.worker.config import DisaggPolicy
from services.worker.kv_link import OnLanded
from services.worker.metrics import HandoffPhase, WorkerMetrics
from services.worker.prefill_peers import HandshakeRefusedError, PrefillPeer, PrefillPeers
from services.worker.prefill_service import DrainingError
from services.worker.remote_prefill import AttemptResult, FallbackReason, RemotePrefill

log = logging.getLogger(__name__)
_MAX_REMOTE_ATTEMPTS = 2  # the preferred prefill worker, then one other


class PrefillMode(StrEnum):
    AUTO = "auto"  # conditional disaggregation (DisaggPolicy)
    REMOTE = "remote"
    LOCAL = "local"


class PrefillPath(StrEnum):
    REMOTE = "remote"
    LOCAL = "local"
    LOCAL_FALLBACK = "local_fallback"


@dataclass(frozen=True)
class GenerateJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    mode: PrefillMode = PrefillMode.AUTO
    prefill_worker: str = ""  # preferred prefill worker (host:port); empty: any configured
    traceparent: str = ""  # W3C trace context of the caller, forwarded to the prefill worker


@dataclass(frozen=True)
class GenerateEvent:
    output: RequestOutput
    prefill_path: PrefillPath | None = None  # on the first event only
    fallback_reason: FallbackReason | None = None  # on the first event of a fallen-back request


@dataclass
class _Flow:
    job: GenerateJob
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    events: asyncio.Queue[GenerateEvent | BaseException | None] = field(default_factory=asyncio.Queue)
    engine_rid: str = ""
    in_engine: bool = False
    attempts: int = 0
    peer_address: str = ""  # the prefill worker of the latest remote attempt
    task: asyncio.Task[None] | None = None

    def next_engine_rid(self) -> str:
        self.engine_rid = f"{self.job.request_id}@{self.attempts}"
        self.attempts += 1
        return self.engine_rid


_Prefilled = tuple[AsyncIterator[RequestOutput] | None, PrefillPath, FallbackReason | None]


class DecodeService:
    def __init__(self, engine: AsyncEngine, policy: DisaggPolicy, metrics: WorkerMetrics,
                 remote: RemotePrefill | None = None, peers: PrefillPeers | None = None,
                 verifier: LandedVerifier | None = None) -> None:
        """`remote`, `peers`, `verifier`: a decode worker's; a `both` worker has none."""
        self._engine = engine
        self._policy = policy
        self._metrics = metrics
        self._remote = remote
        self._peers = peers
        self._verifier = verifier
        self._flows: dict[str, _Flow] = {}
        self._quarantined: set[str] = set()  # engine ids holding blocks a late WRITE may still hit
        self._reclaimed_early: set[str] = set()  # reported reclaimable before we registered them
        self.draining = False

    @property
    def num_flows(self) -> int:
        return len(self._flows)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)

    async def generate(self, job: GenerateJob) -> AsyncIterator[GenerateEvent]:
        """Stream a request's events; raises InvalidRequestError / DrainingError before starting.
        Leaving the iteration early (client gone) aborts the request."""
        if self.draining:
            raise DrainingError("the decode worker is draining")
        if job.request_id in self._flows:
            raise InvalidRequestError(f"duplicate request id {job.request_id!r}")
        flow = _Flow(job)
        self._flows[job.request_id] = flow
        flow.task = asyncio.create_task(self._run(flow), name=f"flow-{job.request_id}")
        flow.task.add_done_callback(lambda _: self._forget(flow))
        backlog: deque[GenerateEvent | BaseException | None] = deque()
        try:
            while (item := backlog.popleft() if backlog else await flow.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                while not flow.events.empty():
                    backlog.append(flow.events.get_nowait())
                yield _coalesce(item, backlog)
        finally:
            if not flow.task.done():
                self._abort_flow(flow)

    async def abort(self, request_id: str) -> bool:
        flow = self._flows.get(request_id)
        if flow is None:
            return False
        self._abort_flow(flow)
        return True

    def abort_all(self) -> None:
        for flow in list(self._flows.values()):
            self._abort_flow(flow)

    async def wait_idle(self, timeout_s: float) -> bool:
        tasks = [f.task for f in self._flows.values() if f.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return not self._flows

    def on_reclaimable(self, engine_rid: str) -> None:
        """KV link: a quarantined attempt's blocks can no longer be written; free them."""
        if engine_rid in self._quarantined:
            self._quarantined.discard(engine_rid)
            asyncio.ensure_future(self._engine.abort(engine_rid))
        else:
            self._reclaimed_early.add(engine_rid)

    # ---- the flow -------------------------------------------------------------------------------
    def _forget(self, flow: _Flow) -> None:
        if self._flows.get(flow.job.request_id) is flow:
            del self._flows[flow.job.request_id]

    def _abort_flow(self, flow: _Flow) -> None:
        flow.aborted.set()
        if flow.in_engine:
            asyncio.ensure_future(self._engine.abort(flow.engine_rid))

    async def _run(self, flow: _Flow) -> None:
        try:
            stream, path, reason = await self._prefill(flow)
            self._metrics.prefill_path.labels(path.value).inc()
            if stream is None:
                abort = RequestOutput(flow.job.request_id, (), "", finish_reason=FinishReason.ABORT)
                flow.events.put_nowait(GenerateEvent(abort, path, reason))
                return
            first = True
            async for out in stream:
                self._metrics.tokens.labels("generated").inc(len(out.new_token_ids))
                flow.events.put_nowait(GenerateEvent(out, path if first else None, reason if first else None))
                first = False
        except Exception as e:  # handed to the caller's stream (typed errors become gRPC statuses)
            if not isinstance(e, InvalidRequestError):
                log.exception("request %s failed", flow.job.request_id)
            flow.events.put_nowait(e)
        finally:
            flow.events.put_nowait(None)

    async def _prefill(self, flow: _Flow) -> _Prefilled:
        """Get the request into the engine: remote attempts, else local. None: aborted first."""
        if not self._wants_remote(flow.job):
            return await self._local(flow), PrefillPath.LOCAL, None
        reason: FallbackReason | None = None
        tried = set[str]()
        for _ in range(_MAX_REMOTE_ATTEMPTS):
            outcome = await self._try_remote(flow, frozenset(tried))
            if isinstance(outcome, tuple):
                return outcome
            if outcome.aborted:
                return None, PrefillPath.REMOTE, None
            if outcome.fallback is FallbackReason.NO_PREFILL_WORKER and reason is not None:
                break  # nobody else to ask: keep the reason the last one failed for
            reason = outcome.fallback or FallbackReason.INTERNAL_ERROR
            self._metrics.fallbacks.labels(reason.value).inc()
            level = logging.ERROR if reason is FallbackReason.CHECKSUM_MISMATCH else logging.WARNING  # loud
            log.log(level, "request %s: remote prefill failed (%s: %s)", flow.job.request_id, reason, outcome.detail)
            tried.add(flow.peer_address)
            if not outcome.retry_elsewhere:
                break
        if flow.aborted.is_set():
            return None, PrefillPath.LOCAL_FALLBACK, reason
        log.warning("request %s: prefilling locally after %s", flow.job.request_id, reason)
        return await self._local(flow), PrefillPath.LOCAL_FALLBACK, reason

    def _wants_remote(self, job: GenerateJob) -> bool:
        if self._remote is None or self._peers is None or not self._peers.configured and not job.prefill_worker:
            return False
        if job.mode is PrefillMode.LOCAL:
            return False
        return job.mode is PrefillMode.REMOTE or self._policy.remote_by_length(len(job.prompt))

    async def _try_remote(self, flow: _Flow, tried: frozenset[str]) -> _Prefilled | AttemptResult:
        """One remote attempt: a finished prefill (stream, path, reason) or why it failed."""
        assert self._peers is not None and self._remote is not None
        job = flow.job
        candidates = self._peers.candidates(job.prefill_worker, exclude=tried)
        if not candidates:
            return AttemptResult(fallback=FallbackReason.NO_PREFILL_WORKER, detail="no usable prefill worker")
        peer = candidates[0]
        flow.peer_address = peer.address
        try:
            await self._peers.connect(peer)
        except HandshakeRefusedError as e:
            return AttemptResult(fallback=FallbackReason.HANDSHAKE_REFUSED, detail=str(e), retry_elsewhere=True)
        except Exception as e:  # transport failure: the peer is marked down
            return AttemptResult(fallback=FallbackReason.PREFILL_UNAVAILABLE, detail=str(e), retry_elsewhere=True)
        if flow.aborted.is_set():
            return AttemptResult(aborted=True)
        erid = flow.next_engine_rid()
        stream = self._engine.open_stream(erid)
        reserved = time.perf_counter()
        force = job.mode is PrefillMode.REMOTE
        reservation = await self._engine.reserve_remote(
            erid, job.prompt, job.params,
            wants_remote=lambda cached: force or self._policy.remote_given_cache(len(job.prompt), cached))
        if not reservation.remote:
            if not reservation.out_of_blocks:
                return await self._enter_engine(flow, stream), PrefillPath.LOCAL, None
            reason = FallbackReason.DECODE_OUT_OF_BLOCKS
            self._metrics.fallbacks.labels(reason.value).inc()
            return await self._enter_engine(flow, stream), PrefillPath.LOCAL_FALLBACK, reason
        return await self._run_attempt(flow, peer, erid, reservation, stream, reserved)

    async def _run_attempt(self, flow: _Flow, peer: PrefillPeer, erid: str, reservation: Reservation,
                           stream: AsyncIterator[RequestOutput], reserved: float) -> _Prefilled | AttemptResult:
        assert self._remote is not None
        job = flow.job
        order = self._remote.order(erid, flow.attempts - 1, job.prompt, job.params, reservation.block_ids,
                                   reservation.num_cached_tokens, job.traceparent)
        if flow.aborted.is_set():
            result = AttemptResult(aborted=True)
        else:
            result = await self._remote.run(order, peer, flow.aborted, on_landed=self._committer(erid))
        if not result.ok:
            await self._drop(erid, result.blocks_safe)
            return result
        problem = result.commit_problem
        assert problem is not None, "the KV link runs the commit hook for every landed attempt"
        if problem:  # not committed: the blocks landed (the WRITE is over) but must never be used
            await self._drop(erid, blocks_safe=True)
            if problem == ABORTED_BEFORE_COMMIT:
                return AttemptResult(aborted=True)
            reason = FallbackReason.INTERNAL_ERROR if result.commit_failed else FallbackReason.CHECKSUM_MISMATCH
            return AttemptResult(fallback=reason, detail=problem)
        self._observe_handoff(result, reserved)
        return await self._enter_engine(flow, stream), PrefillPath.REMOTE, None

    def _committer(self, erid: str) -> OnLanded:
        """The KV link's hook for this attempt: verify and commit on the engine thread the moment the
        DONE notice is seen (no event-loop round trip between the notice and the commit)."""
        def on_landed(landed: LandedKV) -> concurrent.futures.Future[str]:
            token = landed.payload.first_token_id
            if token is None:
                raise ValueError("the DONE notice carries no first token")
            return self._engine.commit_remote_threadsafe(erid, token, landed.payload.first_logprobs,
                                                         verify=self._verify(landed))
        return on_landed

    def _verify(self, landed: LandedKV) -> Callable[[], str]:
        verifier = self._verifier
        return lambda: verifier.problem(landed) if verifier is not None else ""

    def _observe_handoff(self, result: AttemptResult, reserved: float) -> None:
        handoff = time.perf_counter() - reserved
        self._metrics.handoff_seconds.observe(handoff)
        self._metrics.handoff_phase(HandoffPhase.HANDOFF, handoff)
        if result.landed is not None and result.landed.payload.prefill_seconds:
            overhead = max(handoff - result.landed.payload.prefill_seconds, 0.0)
            self._metrics.handoff_phase(HandoffPhase.OVERHEAD, overhead)
        self._metrics.handoff_phase(HandoffPhase.NOTICE_WAIT, result.notice_wait_s)
        committed = result.committed_at or time.monotonic()
        self._metrics.handoff_phase(HandoffPhase.NOTICE_TO_COMMIT, max(committed - result.noticed_at, 0.0))

    async def _local(self, flow: _Flow) -> AsyncIterator[RequestOutput] | None:
        if flow.aborted.is_set():
            return None
        job = flow.job
        erid = flow.next_engine_rid()
        stream = self._engine.open_stream(erid)
        await self._engine.add_request(erid, job.prompt, job.params)
        return await self._enter_engine(flow, stream)

    async def _enter_engine(self, flow: _Flow, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """From here an abort goes through the engine (which ends the stream with ABORT)."""
        flow.in_engine = True
        if flow.aborted.is_set():
            await self._engine.abort(flow.engine_rid)
        return stream

    async def _drop(self, erid: str, blocks_safe: bool) -> None:
        """Give up an attempt's blocks: now if no WRITE can land, else once reclaimable."""
        if blocks_safe or erid in self._reclaimed_early:
            self._reclaimed_early.discard(erid)
            await self._engine.abort(erid)
        else:
            self._quarantined.add(erid)


def _coalesce(event: GenerateEvent, backlog: deque[GenerateEvent | BaseException | None]) -> GenerateEvent:
    """`event` merged with the outputs queued right behind it: a caller that fell behind gets one
    message with several tokens instead of a backlog of one-token messages. Stops at an error or the
    end marker, which stay in `backlog` for the caller's loop."""
    while backlog and isinstance(nxt := backlog[0], GenerateEvent) and not event.output.finished:
        backlog.popleft()
        event = GenerateEvent(_join(event.output, nxt.output), event.prefill_path, event.fallback_reason)
    return event


def _join(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    return RequestOutput(a.request_id, a.new_token_ids + b.new_token_ids, a.new_text + b.new_text,
                         a.logprobs + b.logprobs, b.finish_reason, b.num_prompt_tokens or a.num_prompt_tokens,
                         b.num_cached_tokens or a.num_cached_tokens, b.error or a.error)
