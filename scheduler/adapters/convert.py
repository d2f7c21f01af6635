"""protobuf <-> scheduler.types: the only place the scheduler's messages meet its dataclasses.

Every `*_from_proto` validates as it converts and raises `InvalidMessageError` naming the bad
field, which the servicer turns into INVALID_ARGUMENT: a malformed heartbeat is refused whole,
never half-applied. Block hashes travel as uint64; Python producers may hold them as signed
64-bit ints, so the senders (the gateway's services/gateway/routing/convert.py, the workers'
heartbeats) reduce them modulo 2**64 and every side that compares hashes sees the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import worker_pb2
from scheduler.types import (
    SLO,
    DecisionKind,
    DecodeSample,
    KVEvent,
    KVEventKind,
    KVTier,
    MixedSample,
    PrefillSample,
    RequestSummary,
    RoleSwitch,
    RouteDecision,
    StepSample,
    SwitchState,
    Tier,
    WorkerFailure,
    WorkerRole,
    WorkerSnapshot,
)

_KIND_TO_PROTO = {
    DecisionKind.ROUTE: pb.RouteResponse.KIND_ROUTE,
    DecisionKind.QUEUE: pb.RouteResponse.KIND_QUEUE,
    DecisionKind.DEGRADE: pb.RouteResponse.KIND_DEGRADE,
    DecisionKind.REJECT: pb.RouteResponse.KIND_REJECT,
}
_FAILURES = {
    WorkerFailure.UNAVAILABLE: pb.ReportWorkerFailureRequest.REASON_UNAVAILABLE,
    WorkerFailure.STREAM_BROKEN: pb.ReportWorkerFailureRequest.REASON_STREAM_BROKEN,
}
_FAILURES_FROM_PROTO = {v: k for k, v in _FAILURES.items()}
_KV_KINDS = {pb.KVEvent.KIND_STORED: KVEventKind.STORED, pb.KVEvent.KIND_EVICTED: KVEventKind.EVICTED}
_KV_TIERS = {pb.KVEvent.TIER_GPU: KVTier.GPU, pb.KVEvent.TIER_HOST: KVTier.HOST, pb.KVEvent.TIER_DISK: KVTier.DISK}


class InvalidMessageError(ValueError):
    """A message that cannot become a valid scheduler type; the text names the field."""


_E = TypeVar("_E", Tier, WorkerRole)


def _enum_value(enum: type[_E], value: str, field: str) -> _E:
    try:
        return enum(value)
    except ValueError:
        valid = ", ".join(m.value for m in enum)
        raise InvalidMessageError(f"{field}={value!r} is not one of: {valid}") from None


def snapshot_from_status(status: worker_pb2.WorkerStatus, address: str, now: float) -> WorkerSnapshot:
    """A heartbeat's status as a snapshot; `address` comes from the worker's registration."""
    if not status.worker_id:
        raise InvalidMessageError("status.worker_id is empty")
    if not address:
        raise InvalidMessageError(f"worker {status.worker_id}: address is empty")
    try:
        return WorkerSnapshot(
            worker_id=status.worker_id,
            role=_enum_value(WorkerRole, status.role, "status.role"),
            model=status.model,
            address=address,
            queue_depth=status.queue_depth,
            running_seqs=status.running_seqs,
            free_blocks=status.free_blocks,
            total_blocks=status.total_blocks,
            block_size=status.block_size,
            inflight_prefill_tokens=status.inflight_prefill_tokens,
            heartbeat_at=now,  # WorkerStatus carries no send time; liveness uses receipt time anyway
            running_context_tokens=status.running_context_tokens,
            running_remaining_tokens=status.running_remaining_tokens,
            max_num_seqs=status.max_num_seqs,
            max_prefill_chunk=status.max_prefill_chunk,
            inflight_prefill_requests=status.inflight_prefill_requests,
            waiting_for_remote_kv=status.waiting_for_remote_kv,
            requests_received=status.requests_received if status.HasField("requests_received") else None,
        )
    except InvalidMessageError:
        raise
    except ValueError as e:
        raise InvalidMessageError(str(e)) from e


def status_from_snapshot(snapshot: WorkerSnapshot) -> worker_pb2.WorkerStatus:
    return worker_pb2.WorkerStatus(
        worker_id=snapshot.worker_id,
        role=snapshot.role.value,
        model=snapshot.model,
        queue_depth=snapshot.queue_depth,
        running_seqs=snapshot.running_seqs,
        free_blocks=snapshot.free_blocks,
        total_blocks=snapshot.total_blocks,
        block_size=snapshot.block_size,
        inflight_prefill_tokens=snapshot.inflight_prefill_tokens,
        max_num_seqs=snapshot.max_num_seqs,
        max_prefill_chunk=snapshot.max_prefill_chunk,
        inflight_prefill_requests=snapshot.inflight_prefill_requests,
        running_context_tokens=snapshot.running_context_tokens,
        running_remaining_tokens=snapshot.running_remaining_tokens,
        waiting_for_remote_kv=snapshot.waiting_for_remote_kv,
        requests_received=snapshot.requests_received,
    )


def sample_from_proto(sample: pb.StepSample) -> StepSample:
    if sample.kind == pb.StepSample.KIND_PREFILL:
        attention = sample.attention_tokens_sq if sample.HasField("attention_tokens_sq") else None
        return PrefillSample(tokens=sample.tokens, seconds=sample.seconds, attention_tokens_sq=attention)
    if sample.kind == pb.StepSample.KIND_DECODE:
        return DecodeSample(batch_size=sample.tokens, context_tokens=sample.context_tokens, seconds=sample.seconds)
    if sample.kind == pb.StepSample.KIND_MIXED:
        if not sample.tokens or not sample.decode_seqs:
            raise InvalidMessageError("a mixed step sample needs prefill tokens and decode_seqs > 0")
        attention = sample.attention_tokens_sq if sample.HasField("attention_tokens_sq") else sample.tokens**2
        return MixedSample(prefill_tokens=sample.tokens, attention_tokens_sq=attention, batch_size=sample.decode_seqs,
                           context_tokens=sample.context_tokens, seconds=sample.seconds)
    raise InvalidMessageError(f"step sample kind {sample.kind} is not KIND_PREFILL, KIND_DECODE or KIND_MIXED")


def kv_event_from_proto(event: pb.KVEvent) -> KVEvent:
    kind = _KV_KINDS.get(event.kind)
    if kind is None:
        raise InvalidMessageError(f"KV event kind {event.kind} is not KIND_STORED or KIND_EVICTED")
    tier = _KV_TIERS.get(event.tier)
    if tier is None:
        raise InvalidMessageError(f"KV event tier {event.tier} is not TIER_GPU, TIER_HOST or TIER_DISK")
    return KVEvent(kind=kind, block_hash=event.block_hash, tier=tier)


def summary_from_proto(request: pb.RouteRequest) -> RequestSummary:
    if not request.request_id:
        raise InvalidMessageError("request_id is empty")
    try:
        return RequestSummary(
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            prefix_hashes=tuple(request.prefix_block_hashes),
            tier=_enum_value(Tier, request.tier, "tier"),
            slo=SLO(ttft_ms=request.slo.ttft_ms, tpot_ms=request.slo.tpot_ms),
            max_tokens=request.max_tokens,
            model=request.model,
            conversation_id=request.conversation_id or None,
            num_choices=max(request.num_choices, 1),
        )
    except InvalidMessageError:
        raise
    except ValueError as e:
        raise InvalidMessageError(f"request {request.request_id}: {e}") from e


def response_from_decision(
    decision: RouteDecision, workers: Mapping[str, WorkerSnapshot], asked_max_tokens: int
) -> pb.RouteResponse:
    """The decision with worker ids resolved to addresses (the gateway dials addresses)."""
    response = pb.RouteResponse(
        kind=_KIND_TO_PROTO[decision.kind],
        reason=decision.reason.value if decision.reason else "",
        cached_blocks=decision.cached_blocks,
    )
    if decision.retry_after_s is not None:
        response.retry_after_s = decision.retry_after_s
    if decision.predicted_ttft_ms is not None:
        response.predicted_ttft_ms = decision.predicted_ttft_ms
    if decision.predicted_tpot_ms is not None:
        response.predicted_tpot_ms = decision.predicted_tpot_ms
    if decision.decode_worker_id is not None:
        response.decode_worker_id = decision.decode_worker_id
        response.decode_worker = workers[decision.decode_worker_id].address
    if decision.prefill_worker_id is not None:
        response.prefill_worker_id = decision.prefill_worker_id
        response.prefill_worker = workers[decision.prefill_worker_id].address
    if decision.is_placed:
        response.max_tokens = decision.max_tokens or asked_max_tokens
        response.prefill_reason = decision.prefill_reason.value if decision.prefill_reason else ""
        response.model = decision.model
    return response


_SWITCH_STATES = {
    SwitchState.DRAINING: pb.RoleSwitch.STATE_DRAINING,
    SwitchState.SWITCHING: pb.RoleSwitch.STATE_SWITCHING,
    SwitchState.DONE: pb.RoleSwitch.STATE_DONE,
}


def role_from_proto(role: str) -> WorkerRole:
    return _enum_value(WorkerRole, role, "role")


def role_switch_to_proto(switch: RoleSwitch) -> pb.RoleSwitch:
    return pb.RoleSwitch(
        worker_id=switch.worker_id,
        from_role=switch.from_role.value,
        to_role=switch.to_role.value,
        state=_SWITCH_STATES[switch.state],
    )


def failure_from_proto(report: pb.ReportWorkerFailureRequest) -> WorkerFailure:
    if not report.worker_address:
        raise InvalidMessageError("worker_address is empty")
    reason = _FAILURES_FROM_PROTO.get(report.reason)
    if reason is None:
        raise InvalidMessageError(f"reason {report.reason} is not REASON_UNAVAILABLE or REASON_STREAM_BROKEN")
    return reason
