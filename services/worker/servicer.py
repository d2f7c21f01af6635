"""The Worker gRPC service: a thin edge that converts messages and maps typed errors to statuses.

Status codes: bad input INVALID_ARGUMENT; wrong role or unknown KV peer or incompatible handshake
FAILED_PRECONDITION (the message names the mismatching fields); draining UNAVAILABLE; faults not
enabled PERMISSION_DENIED; anything else INTERNAL. Prefill always ends with the `baton-kv-idle`
trailer when it answers: it answers only once its WRITE is terminal or was never started.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import NoReturn

import grpc

from engine.errors import EngineError, InvalidRequestError
from engine.sampling_params import SamplingParams
from kvtransfer.errors import IncompatiblePeerError, UnknownPeerError
from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from scheduler.types import Tier
from services.rpc import convert
from services.worker.decode_jobs import GenerateEvent, GenerateJob, JobChoice, PrefillMode, PrefillPath
from services.worker.decode_service import DecodeService
from services.worker.faults import WorkerFaults
from services.worker.metrics import WorkerMetrics
from services.worker.prefill_order import PrefillDestination, PrefillOrder
from services.worker.prefill_service import DrainingError, PrefillResult, PrefillService
from services.worker.remote_prefill import KV_IDLE_TRAILER

log = logging.getLogger(__name__)
_IDLE = ((KV_IDLE_TRAILER, "1"),)
_MODES = {pb.PREFILL_MODE_AUTO: PrefillMode.AUTO, pb.PREFILL_MODE_REMOTE: PrefillMode.REMOTE,
          pb.PREFILL_MODE_LOCAL: PrefillMode.LOCAL}
_PATHS = {None: pb.PREFILL_PATH_UNSPECIFIED, PrefillPath.REMOTE: pb.PREFILL_PATH_REMOTE,
          PrefillPath.LOCAL: pb.PREFILL_PATH_LOCAL, PrefillPath.LOCAL_FALLBACK: pb.PREFILL_PATH_LOCAL_FALLBACK}


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, metrics: WorkerMetrics, faults: WorkerFaults, allow_faults: bool,
                 status: Callable[[], Awaitable[pb.WorkerStatus]], decode: DecodeService | None = None,
                 prefill: PrefillService | None = None) -> None:
        self._worker_id = worker_id
        self._metrics = metrics
        self._faults = faults
        self._allow_faults = allow_faults
        self._status = status
        self._decode = decode
        self._prefill = prefill

    def set_role_services(self, decode: DecodeService | None, prefill: PrefillService | None) -> None:
        """After a role switch (services/worker/role_switch.py): answer for the new role's services."""
        self._decode = decode
        self._prefill = prefill

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 - gRPC method name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if self._decode is None:
            await self._abort(context, "Generate", grpc.StatusCode.FAILED_PRECONDITION,
                              "this is a prefill worker: Generate is served by decode and both workers")
        assert self._decode is not None
        try:
            priority = _tier_priority(request.tier)
            job = GenerateJob(request.request_id or _missing("request_id"),
                              convert.prompt_from_proto(request.prompt_token_ids),
                              _sampling(request.sampling, priority),
                              _MODES.get(request.prefill_mode, PrefillMode.AUTO), request.prefill_worker,
                              _traceparent(context), tuple(_choice(c, priority) for c in request.choices))
            async for event in self._decode.generate(job):
                yield _response(event, event.request_id or job.request_id)
        except InvalidRequestError as e:
            await self._abort(context, "Generate", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except DrainingError as e:
            await self._abort(context, "Generate", grpc.StatusCode.UNAVAILABLE, str(e))
        except EngineError as e:
            await self._abort(context, "Generate", grpc.StatusCode.INTERNAL, f"engine error: {e}")
        except Exception as e:
            log.exception("Generate %s failed", request.request_id)
            await self._abort(context, "Generate", grpc.StatusCode.INTERNAL, f"internal error: {e}")
        self._metrics.requests.labels("Generate", "OK").inc()

    async def Abort(self, request: pb.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        existed = False
        if self._decode is not None:
            existed = await self._decode.abort(request.request_id)
        if self._prefill is not None:
            existed = self._prefill.abort(request.request_id) or existed
        self._metrics.requests.labels("Abort", "OK").inc()
        log.info("Abort(%s): %s", request.request_id, "aborted" if existed else "not running here")
        return pb.AbortResponse(existed=existed)

    async def Prefill(self, request: pb.PrefillRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if self._prefill is None:
            await self._abort(context, "Prefill", grpc.StatusCode.FAILED_PRECONDITION,
                              "this is not a prefill worker", _IDLE)
        assert self._prefill is not None
        log.debug("Prefill %s traceparent=%s", request.request_id, _traceparent(context))
        try:
            result = await self._prefill.prefill(PrefillOrder.from_proto(request, _traceparent(context)))
        except (InvalidRequestError, ValueError) as e:
            await self._abort(context, "Prefill", grpc.StatusCode.INVALID_ARGUMENT, str(e), _IDLE)
        except UnknownPeerError as e:
            await self._abort(context, "Prefill", grpc.StatusCode.FAILED_PRECONDITION, str(e), _IDLE)
        except DrainingError as e:
            await self._abort(context, "Prefill", grpc.StatusCode.UNAVAILABLE, str(e), _IDLE)
        except Exception as e:  # raised before the WRITE was posted or after the job ended: idle
            log.exception("Prefill %s failed", request.request_id)
            await self._abort(context, "Prefill", grpc.StatusCode.INTERNAL, f"prefill failed: {e}", _IDLE)
        context.set_trailing_metadata(_IDLE)  # the job is terminal: nothing more will land
        self._metrics.requests.labels("Prefill", "OK").inc()
        return _prefill_response(result)

    async def PrefillDestination(self, request: pb.PrefillDestinationRequest,  # noqa: N802
                                 context: grpc.aio.ServicerContext) -> pb.PrefillDestinationResponse:
        if self._prefill is None:
            await self._abort(context, "PrefillDestination", grpc.StatusCode.FAILED_PRECONDITION,
                              "this is not a prefill worker")
        assert self._prefill is not None
        try:
            why = self._prefill.place(PrefillDestination.from_proto(request))
        except InvalidRequestError as e:
            await self._abort(context, "PrefillDestination", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self._metrics.requests.labels("PrefillDestination", "OK").inc()
        return pb.PrefillDestinationResponse(accepted=not why, reason=why)

    async def Handshake(self, request: pb.HandshakeRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        if self._prefill is None:
            await self._abort(context, "Handshake", grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {self._worker_id} is not a prefill worker")
        assert self._prefill is not None
        try:
            mine = await self._prefill.handshake(convert.handshake_from_proto(request.decode))
        except IncompatiblePeerError as e:
            log.error("refused KV handshake from %s: %s", request.worker_id, e)
            await self._abort(context, "Handshake", grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            await self._abort(context, "Handshake", grpc.StatusCode.INVALID_ARGUMENT, f"bad handshake: {e}")
        self._metrics.requests.labels("Handshake", "OK").inc()
        return pb.HandshakeResponse(prefill=convert.handshake_to_proto(mine), worker_id=self._worker_id)

    async def GetStatus(self, request: pb.StatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.WorkerStatus:
        return await self._status()

    async def InjectFault(self, request: pb.InjectFaultRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.InjectFaultResponse:
        if not self._allow_faults:
            await self._abort(context, "InjectFault", grpc.StatusCode.PERMISSION_DENIED,
                              "fault injection is off (start the worker with --allow-fault-injection)")
        try:
            self._faults.arm(request.fault, request.times, request.delay_s)
        except ValueError as e:
            await self._abort(context, "InjectFault", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.warning("fault armed: %s x%d", request.fault, max(request.times, 1))
        return pb.InjectFaultResponse()

    async def _abort(self, context: grpc.aio.ServicerContext, rpc: str, code: grpc.StatusCode, details: str,
                     trailers: tuple[tuple[str, str], ...] = ()) -> NoReturn:
        self._metrics.requests.labels(rpc, code.name).inc()
        await context.abort(code, details, trailing_metadata=trailers)
        raise AssertionError("unreachable: context.abort raises")


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == "traceparent"), "")


def _choice(msg: pb.Choice, priority: int | None) -> JobChoice:
    return JobChoice(msg.request_id or _missing("choices.request_id"), _sampling(msg.sampling, priority))


def _sampling(msg: pb.SamplingParams, priority: int | None) -> SamplingParams:
    params = convert.sampling_from_proto(msg)
    return params if priority is None else replace(params, priority=priority)


def _tier_priority(tier: str) -> int | None:
    """The admission priority of a Generate request's tier (None: no tier, the sampling's own applies):
    under overload a worker's waiting queue holds several tiers, and an enterprise request must not wait
    behind free ones that the scheduler placed a moment earlier."""
    if not tier:
        return None
    try:
        return Tier(tier).priority
    except ValueError:
        raise InvalidRequestError(f"tier must be one of {[t.value for t in Tier]}, got {tier!r}") from None


def _missing(field: str) -> str:
    raise InvalidRequestError(f"{field} is empty")


def _response(event: GenerateEvent, request_id: str) -> pb.GenerateResponse:
    msg = convert.output_to_proto(event.output, request_id)
    msg.prefill_path = _PATHS[event.prefill_path]
    msg.fallback_reason = event.fallback_reason.value if event.fallback_reason is not None else ""
    return msg


def _prefill_response(result: PrefillResult) -> pb.PrefillResponse:
    msg = pb.PrefillResponse(
        request_id=result.request_id,
        first_token_id=result.first_token_id or 0,
        outcome=convert.outcome_to_proto(result.state),
        reason=result.reason,
        prefill_seconds=result.prefill_seconds,
        transfer_seconds=result.transfer_seconds,
        transfer_bytes=result.transfer_bytes,
        num_prefill_cached_tokens=result.num_prefill_cached_tokens,
    )
    if result.first_logprobs is not None:
        msg.first_logprob.CopyFrom(convert.logprob_to_proto(result.first_logprobs))
    return msg
