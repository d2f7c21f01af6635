"""`WorkerClient`: the gateway's side of a worker's `Generate` stream, as plain data.

One gRPC channel per worker address, shared by every request. `generate()` returns a
`GenerationStream`: iterate it for `GenerationDelta`s; `abort()` cancels the call (the worker sees the
cancellation and frees the sequence's KV blocks) and also sends an explicit `Abort(request_id)`, so a
worker that missed the cancellation (a proxy in between, a race with its own scheduling) frees them
too. The W3C trace context of the current span rides in the call's metadata (`traceparent`).

gRPC statuses are classified (`FailureKind`) before they become typed errors: a worker that is gone
(UNAVAILABLE: refused, reset, closed, draining; or a stream that ends without a finish reason) raises
`WorkerLostError`, which the runner answers with a retry or a migration to another worker; the request's
own faults (INVALID_ARGUMENT -> 400), a full worker (RESOURCE_EXHAUSTED -> 503, retry later) and the
worker's failures (anything else -> 502) are never retried: re-running them elsewhere would not help.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum

import grpc

from rpcgen.baton.v1 import worker_pb2 as wpb
from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
from scheduler.types import WorkerFailure
from services.common.cluster_auth import ClusterToken
from services.common.errors import BatonError
from services.gateway.errors import BadRequestError, OverloadedError, UpstreamError
from services.gateway.tracing import grpc_trace_metadata
from tokenization.finish_reason import FinishReason

log = logging.getLogger(__name__)

FINISH_REASONS = {
    wpb.FINISH_REASON_STOP: FinishReason.STOP,
    wpb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    wpb.FINISH_REASON_ABORT: FinishReason.ABORT,
    wpb.FINISH_REASON_ERROR: FinishReason.ERROR,
    wpb.FINISH_REASON_CONTENT_FILTER: FinishReason.CONTENT_FILTER,
}
_SEED_MOD = 2**63  # the engine's seed range is [0, 2**63)


@dataclass(frozen=True)
class SamplingSpec:
    """What one generation samples with (OpenAI names; None means the worker's default)."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k
    num_draft_tokens: int | None = None  # speculative decoding draft length; None: the worker's default
    guided: tuple[int, str] | None = None  # (worker_pb2.GuidedKind, spec): grammar-constrained output
    prior_output_tokens: int = 0  # a migration's prompt ends with this many tokens generated before
    ignore_eos: bool = False  # the EOS token does not finish the generation (stop strings still do)
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def to_proto(self) -> wpb.SamplingParams:
        params = wpb.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p or 0.0, stop=list(self.stop),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            prior_output_tokens=self.prior_output_tokens, ignore_eos=self.ignore_eos, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop_token_ids=list(self.stop_token_ids))
        if self.seed is not None:
            params.seed = self.seed % _SEED_MOD
        if self.logprobs is not None:
            params.logprobs = self.logprobs
        if self.num_draft_tokens is not None:
            params.num_draft_tokens = self.num_draft_tokens
        if self.guided is not None:
            params.guided.kind, params.guided.spec = self.guided  # type: ignore[assignment]
        return params


def derive_seed(seed: int | None, index: int) -> int | None:
    """Choice `index` of an n>1 request: seed + index, so choices differ yet replay identically."""
    return None if seed is None else (seed + index) % _SEED_MOD


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class GenerationDelta:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0  # 0 on responses after the first
    num_cached_tokens: int = 0
    error: str = ""


def delta_from_proto(msg: wpb.GenerateResponse) -> GenerationDelta:
    return GenerationDelta(
        token_ids=tuple(msg.token_ids), text=msg.text,
        logprobs=tuple(TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                       for lp in msg.logprobs),
        finish_reason=FINISH_REASONS.get(msg.finish_reason), num_prompt_tokens=msg.num_prompt_tokens,
        num_cached_tokens=msg.num_cached_tokens, error=msg.error)


class FailureKind(StrEnum):
    """Why a worker call failed, which decides whether another worker may take the generation over."""

    WORKER_LOST = "worker_lost"  # the worker is gone or going: retried / migrated elsewhere
    BAD_REQUEST = "bad_request"  # the request itself is wrong: never retried
    OVERLOADED = "overloaded"  # the worker is full: the client retries later (503)
    WORKER_FAILED = "worker_failed"  # the worker failed this request (engine error): not retried

    @classmethod
    def of(cls, code: grpc.StatusCode) -> FailureKind:
        return _FAILURES.get(code, cls.WORKER_FAILED)


_FAILURES = {grpc.StatusCode.UNAVAILABLE: FailureKind.WORKER_LOST,
             grpc.StatusCode.INVALID_ARGUMENT: FailureKind.BAD_REQUEST,
             grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.OVERLOADED}


class WorkerLostError(UpstreamError):
    """The worker died, went away or broke the stream mid-generation (502 if nobody takes over)."""

    def __init__(self, message: str, address: str, reason: WorkerFailure) -> None:
        super().__init__(message)
        self.address = address
        self.reason = reason  # reported to the scheduler (routing.py)


def error_from_status(e: grpc.aio.AioRpcError, address: str) -> BatonError:
    details = e.details() or e.code().name
    kind = FailureKind.of(e.code())
    if kind is FailureKind.BAD_REQUEST:
        return BadRequestError(f"the worker refused the request: {details}")
    if kind is FailureKind.OVERLOADED:
        return OverloadedError(f"worker {address} is out of capacity: {details}", retry_after_s=1.0)
    if kind is FailureKind.WORKER_LOST:
        return WorkerLostError(f"worker {address} is unavailable: {details}", address, WorkerFailure.UNAVAILABLE)
    return UpstreamError(f"worker {address} failed: {e.code().name}: {details}")


@dataclass(frozen=True)
class GenerateTarget:
    """Where a generation runs (from the routing decision)."""

    decode_address: str
    prefill_address: str | None = None
    # Without a prefill address: True means the scheduler chose to prefill on the decode worker; False
    # (routed without the scheduler) lets the decode worker decide with its own prefill peers.
    local_prefill_decided: bool = True

    @property
    def prefill_mode(self) -> int:
        if self.prefill_address:
            return wpb.PREFILL_MODE_REMOTE
        return wpb.PREFILL_MODE_LOCAL if self.local_prefill_decided else wpb.PREFILL_MODE_AUTO


class GenerationStream:
    """One `Generate` call. Iterate once; `abort()` is idempotent and safe after the end."""

    def __init__(self, client: WorkerClient, target: GenerateTarget, request: wpb.GenerateRequest) -> None:
        self._client = client
        self._target = target
        self._request_id = request.request_id
        stub = client.stub(target.decode_address)
        self._call = stub.Generate(request, metadata=client.call_metadata())
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[GenerationDelta]:
        try:
            async for msg in self._call:
                delta = delta_from_proto(msg)
                if delta.finish_reason is not None:
                    self.finished = True
                yield delta
            if not self.finished:  # closed "OK" without a finish reason: a broken stream, as a reset is
                self.finished = True
                address = self._target.decode_address
                raise WorkerLostError(f"worker {address} ended the stream without finishing", address,
                                      WorkerFailure.STREAM_BROKEN)
        except grpc.aio.AioRpcError as e:
            self.finished = True
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_status(e, self._target.decode_address) from e

    def abort(self) -> None:
        """Stop generating now: cancel the call and tell the worker, in the background."""
        if self.finished:
            return
        self.finished = True
        log.info("Generate %s on %s: aborting (call cancelled, Abort sent)", self._request_id,
                 self._target.decode_address)
        self._call.cancel()
        self._client.send_abort(self._target.decode_address, self._request_id)


@dataclass
class WorkerClient:
    abort_timeout_s: float = 2.0
    cluster_token: ClusterToken | None = None  # workers refuse calls without it
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    def stub(self, address: str) -> wpb_grpc.WorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return wpb_grpc.WorkerStub(channel)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: the trace context and the cluster token. Passed per call, not by channel
        interceptors: on this per-request path an aio interceptor costs more than the call's own work."""
        token = () if self.cluster_token is None else (self.cluster_token.metadata,)
        return (*grpc_trace_metadata(), *token)

    def generate(self, target: GenerateTarget, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingSpec, tier: str) -> GenerationStream:
        request = wpb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                      sampling=sampling.to_proto(), prefill_mode=target.prefill_mode,  # type: ignore[arg-type]
                                      prefill_worker=target.prefill_address or "", tier=tier)
        return GenerationStream(self, target, request)

    async def status(self, address: str, timeout_s: float = 2.0) -> wpb.WorkerStatus:
        try:
            return await self.stub(address).GetStatus(wpb.StatusRequest(), timeout=timeout_s,
                                                      metadata=self.call_metadata())
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e, address) from e

    def send_abort(self, address: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(address, request_id))
        self._background.add(task)  # the loop keeps tasks weakly
        task.add_done_callback(self._background.discard)

    async def _abort(self, address: str, request_id: str) -> None:
        try:
            reply = await self.stub(address).Abort(wpb.AbortRequest(request_id=request_id),
                                                   timeout=self.abort_timeout_s, metadata=self.call_metadata())
            log.info("Abort(%s) to %s: %s", request_id, address, "aborted" if reply.existed else "already ended")
        except grpc.aio.AioRpcError as e:  # the cancellation alone still frees the blocks
            log.info("Abort(%s) to %s not delivered: %s", request_id, address, e.code().name)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=self.abort_timeout_s)
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._channels.clear()
