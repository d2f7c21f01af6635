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

n > 1 (`GenerateJob.choices`): one flow serves every choice of the prompt. A remote attempt reserves
blocks for choice 0 only, the prefill worker samples every choice's first token from the same logits
(`PrefillOrder.choice_params`), and the commit forks the other choices onto the landed prompt blocks
(engine/choices.py: shared by reference, the last partly filled block copied on write). Each choice
is aborted on its own (`abort(choice id)`); the remote attempt is stopped only once all are. A local
prefill (short prompt, fallback, `both` worker) runs the choices as independent engine requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from engine.async_engine import AsyncEngine, Reservation
from engine.batch import SampledToken
from engine.choices import ChoiceFork
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason, RequestOutput
from engine.remote_commit import CommitOutcome, CommitStatus
from kvtransfer.base import LandedKV
from kvtransfer.integrity import LandedVerifier
from services.worker.config import DisaggPolicy
from services.worker.decode_flow import DecodeFlow
from services.worker.decode_jobs import (
    GenerateEvent,
    GenerateJob,
    PrefillMode,
    PrefillPath,
    coalesce,
)
from services.worker.intake import Intake
from services.worker.kv_link import OnLanded
from services.worker.metrics import HandoffPhase, WorkerMetrics
from services.worker.prefill_peers import HandshakeRefusedError, PrefillPeer, PrefillPeers
from services.worker.prefill_service import DrainingError
from services.worker.remote_prefill import AskedPrefill, AttemptResult, FallbackReason, RemotePrefill

log = logging.getLogger(__name__)
_MAX_REMOTE_ATTEMPTS = 2  # the preferred prefill worker, then one other


# Per choice its engine stream (None: aborted before it reached the engine), where it was prefilled, why.
_Prefilled = tuple[list[AsyncIterator[RequestOutput] | None] | None, PrefillPath, FallbackReason | None]


class DecodeService:
    def __init__(self, engine: AsyncEngine, policy: DisaggPolicy, metrics: WorkerMetrics,
                 remote: RemotePrefill | None = None, peers: PrefillPeers | None = None,
                 verifier: LandedVerifier | None = None, intake: Intake | None = None) -> None:
        """`remote`, `peers`, `verifier`: a decode worker's; a `both` worker has none. `intake`: counts each
        flow once its first engine command is submitted (services/worker/intake.py)."""
        self._engine = engine
        self._intake = intake or Intake()
        self._policy = policy
        self._metrics = metrics
        self._remote = remote
        self._peers = peers
        self._verifier = verifier
        self._flows: dict[str, DecodeFlow] = {}
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
        ids = job.choice_ids
        if len(set(ids)) != len(ids) or any(rid in self._flows for rid in ids):
            raise InvalidRequestError(f"duplicate request id among {list(ids)!r}")
        flow = DecodeFlow(job)
        for rid in ids:
            self._flows[rid] = flow
        flow.task = asyncio.create_task(self._run(flow), name=f"flow-{job.request_id}")
        flow.task.add_done_callback(lambda _: self._forget(flow))
        backlog: deque[GenerateEvent | BaseException | None] = deque()
        try:
            while (item := backlog.popleft() if backlog else await flow.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                while not flow.events.empty():
                    backlog.append(flow.events.get_nowait())
                yield coalesce(item, backlog)
        finally:
            if not flow.task.done():
                log.info("Generate %s: the caller left before the end; aborting it", job.request_id)
                self._abort_flow(flow)

    async def abort(self, request_id: str) -> bool:
        """Abort one choice (the only one unless n > 1)."""
        flow = self._flows.get(request_id)
        if flow is None:
            return False
        self._abort_choice(flow, flow.job.choice_ids.index(request_id))
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
    def _forget(self, flow: DecodeFlow) -> None:
        for rid in flow.job.choice_ids:
            if self._flows.get(rid) is flow:
                del self._flows[rid]

    def _abort_flow(self, flow: DecodeFlow) -> None:
        for i in flow.live():
            self._abort_choice(flow, i)

    def _abort_choice(self, flow: DecodeFlow, i: int) -> None:
        """In the engine: abort that choice's sequence. Before: it is left out of the commit's forks (or
        aborted right after it), and the remote attempt stops once no choice is left."""
        if flow.choice_aborted[i]:
            return
        flow.choice_aborted[i] = True
        if not flow.live():
            flow.aborted.set()
        if flow.in_engine:
            asyncio.ensure_future(self._engine.abort(flow.engine_rids[i]))

    async def _run(self, flow: DecodeFlow) -> None:
        try:
            streams, path, reason = await self._prefill(flow)
            self._metrics.prefill_path.labels(path.value).inc()
            streams = streams or [None] * len(flow.job.choice_ids)
            await asyncio.gather(*(self._pump(flow, i, s, path, reason) for i, s in enumerate(streams)))
        except Exception as e:  # handed to the caller's stream (typed errors become gRPC statuses)
            if not isinstance(e, InvalidRequestError):
                log.exception("request %s failed", flow.job.request_id)
            flow.events.put_nowait(e)
        finally:
            flow.events.put_nowait(None)

    async def _pump(self, flow: DecodeFlow, i: int, stream: AsyncIterator[RequestOutput] | None, path: PrefillPath,
                    reason: FallbackReason | None) -> None:
        """One choice's engine outputs onto the flow's queue; its first carries where it was prefilled."""
        rid = flow.job.choice_ids[i]
        if stream is None:
            abort = RequestOutput(rid, (), "", finish_reason=FinishReason.ABORT)
            flow.events.put_nowait(GenerateEvent(abort, path, reason, rid))
            return
        first = True
        async for out in stream:
            self._metrics.tokens.labels("generated").inc(len(out.new_token_ids))
            flow.events.put_nowait(GenerateEvent(out, path if first else None, reason if first else None, rid))
            first = False

    async def _prefill(self, flow: DecodeFlow) -> _Prefilled:
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

    async def _try_remote(self, flow: DecodeFlow, tried: frozenset[str]) -> _Prefilled | AttemptResult:
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
        # Opened before a commit publishes; None once a choice is left out.
        streams: list[AsyncIterator[RequestOutput] | None] = [self._engine.open_stream(r) for r in flow.engine_rids]
        reserved = time.perf_counter()
        force = job.mode is PrefillMode.REMOTE
        asked = self._remote.ask_early(peer, erid, flow.attempts - 1, job.prompt, job.params, job.traceparent,
                                       job.choice_params[1:])  # overlaps the reservation (remote_prefill.py)
        self._taken(flow)  # same turn as the engine command below (intake.py)
        reservation = await self._engine.reserve_remote(
            erid, job.prompt, job.params,
            wants_remote=lambda cached: force or self._policy.remote_given_cache(len(job.prompt), cached))
        self._metrics.handoff_phase(HandoffPhase.RESERVE, time.perf_counter() - reserved)
        if not reservation.remote:  # choice 0 is queued locally: so are the others
            if asked is not None:
                self._remote.withdraw(peer, erid, asked)
            for rid, params in zip(flow.engine_rids[1:], job.choice_params[1:], strict=True):
                await self._engine.add_request(rid, job.prompt, params)
            if not reservation.out_of_blocks:
                return await self._enter_engine(flow, streams), PrefillPath.LOCAL, None
            reason = FallbackReason.DECODE_OUT_OF_BLOCKS
            self._metrics.fallbacks.labels(reason.value).inc()
            return await self._enter_engine(flow, streams), PrefillPath.LOCAL_FALLBACK, reason
        return await self._run_attempt(flow, peer, reservation, streams, reserved, asked)

    async def _run_attempt(self, flow: DecodeFlow, peer: PrefillPeer, reservation: Reservation,
                           streams: list[AsyncIterator[RequestOutput] | None], reserved: float,
                           asked: AskedPrefill | None) -> _Prefilled | AttemptResult:
        assert self._remote is not None
        job, erid = flow.job, flow.engine_rid
        order = self._remote.order(erid, flow.attempts - 1, job.prompt, job.params, reservation.block_ids,
                                   reservation.num_cached_tokens, job.traceparent, job.choice_params[1:])
        if flow.aborted.is_set():
            if asked is not None:
                self._remote.withdraw(peer, erid, asked)
            result = AttemptResult(aborted=True)
        else:
            result = await self._remote.run(order, peer, flow.aborted, self._committer(flow), asked)
        if not result.ok:
            await self._drop(flow, result.blocks_safe)
            return result
        commit = result.commit
        assert commit is not None, "the KV link runs the commit hook for every landed attempt"
        if not commit.committed:  # the blocks landed (the WRITE is over) but must never be used
            await self._drop(flow, blocks_safe=True)
            if commit.status is CommitStatus.ABORTED:
                return AttemptResult(aborted=True)
            failed = commit.status is CommitStatus.FAILED
            reason = FallbackReason.INTERNAL_ERROR if failed else FallbackReason.CHECKSUM_MISMATCH
            return AttemptResult(fallback=reason, detail=commit.problem)
        self._observe_handoff(result, reserved)
        return await self._enter_engine(flow, streams), PrefillPath.REMOTE, None

    def _committer(self, flow: DecodeFlow) -> OnLanded:
        """The KV link's hook for this attempt: verify and commit on the engine thread the moment the
        DONE notice is seen (no event-loop round trip between the notice and the commit)."""
        erid = flow.engine_rid

        def on_landed(landed: LandedKV) -> concurrent.futures.Future[CommitOutcome]:
            token = landed.payload.first_token_id
            if token is None:
                raise ValueError("the DONE notice carries no first token")
            return self._engine.commit_remote_threadsafe(erid, token, landed.payload.first_logprobs,
                                                         verify=self._verify(landed), forks=self._forks(flow, landed))
        return on_landed

    @staticmethod
    def _forks(flow: DecodeFlow, landed: LandedKV) -> Callable[[], tuple[ChoiceFork, ...]]:
        """The other choices to fork at the commit (engine thread): those not aborted by then."""
        def forks() -> tuple[ChoiceFork, ...]:
            firsts = landed.payload.choice_first
            if len(firsts) != len(flow.job.choices):
                raise ValueError(f"the DONE notice carries {len(firsts)} choices' first tokens, "
                                 f"not {len(flow.job.choices)}")
            return tuple(ChoiceFork(flow.engine_rids[i], flow.job.choice_params[i], SampledToken(*firsts[i - 1]))
                         for i in range(1, len(flow.engine_rids)) if not flow.choice_aborted[i])
        return forks

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

    async def _local(self, flow: DecodeFlow) -> list[AsyncIterator[RequestOutput] | None] | None:
        """Every live choice as an engine request of its own (None: all aborted first)."""
        if flow.aborted.is_set():
            return None
        job = flow.job
        flow.next_engine_rid()
        streams: list[AsyncIterator[RequestOutput] | None] = [None] * len(flow.engine_rids)
        for i in flow.live():
            streams[i] = self._engine.open_stream(flow.engine_rids[i])
            self._taken(flow)  # same turn as the engine command below (intake.py)
            await self._engine.add_request(flow.engine_rids[i], job.prompt, job.choice_params[i])
        return await self._enter_engine(flow, streams)

    def _taken(self, flow: DecodeFlow) -> None:
        """Count the flow as taken on, once (a local fallback after a remote attempt is the same request)."""
        if not flow.counted:
            flow.counted = True
            self._intake.take()

    async def _enter_engine(self, flow: DecodeFlow, streams: list[AsyncIterator[RequestOutput] | None],
                            ) -> list[AsyncIterator[RequestOutput] | None]:
        """From here an abort goes through the engine (which ends the stream with ABORT). A choice
        aborted until now (so maybe never forked) is aborted in the engine, which also drops its stream."""
        flow.in_engine = True
        for i, aborted in enumerate(flow.choice_aborted):
            if aborted:
                await self._engine.abort(flow.engine_rids[i])
                streams[i] = None
        return streams

    async def _drop(self, flow: DecodeFlow, blocks_safe: bool) -> None:
        """Give up an attempt: its choices' streams now; its blocks (all choice 0's) now if no WRITE
        can land, else once reclaimable."""
        for rid in flow.engine_rids[1:]:
            await self._engine.abort(rid)  # never forked: this only drops the stream
        erid = flow.engine_rid
        if blocks_safe or erid in self._reclaimed_early:
            self._reclaimed_early.discard(erid)
            await self._engine.abort(erid)
        else:
            self._quarantined.add(erid)
