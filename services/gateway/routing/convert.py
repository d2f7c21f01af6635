"""The gateway's side of the scheduler's wire: what it sends (a request's summary, a worker's failure) and the
reason it reads back. The scheduler converts its own side (scheduler/adapters/convert.py); the two meet only in
the generated protobuf code."""

from __future__ import annotations

import logging

from rpcgen.baton.v1 import scheduler_pb2 as pb
from scheduler.types import Reason, RequestSummary, WorkerFailure

log = logging.getLogger(__name__)

# Block hashes travel as uint64; the gateway holds them as Python ints that may be signed 64-bit, so they are
# reduced modulo 2**64 (two's complement, a no-op for unsigned values) and both sides compare the same numbers.
_UINT64_MASK = (1 << 64) - 1
_FAILURES = {
    WorkerFailure.UNAVAILABLE: pb.ReportWorkerFailureRequest.REASON_UNAVAILABLE,
    WorkerFailure.STREAM_BROKEN: pb.ReportWorkerFailureRequest.REASON_STREAM_BROKEN,
}
_REASONS = {reason.value: reason for reason in Reason}


def summary_to_proto(summary: RequestSummary) -> pb.RouteRequest:
    return pb.RouteRequest(
        request_id=summary.request_id,
        num_prompt_tokens=summary.num_prompt_tokens,
        prefix_block_hashes=[h & _UINT64_MASK for h in summary.prefix_hashes],
        tier=summary.tier.value,
        slo=pb.SLO(ttft_ms=summary.slo.ttft_ms, tpot_ms=summary.slo.tpot_ms),
        max_tokens=summary.max_tokens,
        conversation_id=summary.conversation_id or "",
        model=summary.model,
        num_choices=summary.num_choices,
    )


def failure_report_to_proto(address: str, reason: WorkerFailure, detail: str) -> pb.ReportWorkerFailureRequest:
    return pb.ReportWorkerFailureRequest(worker_address=address, reason=_FAILURES[reason], detail=detail)


def reason_from_proto(text: str) -> Reason | None:
    """The Route answer's reason; None when it has none. A scheduler newer than this gateway may send a reason
    the gateway does not know: the answer still counts (the reason only labels logs and errors), so it is
    logged and read as None rather than refused."""
    if not text:
        return None
    reason = _REASONS.get(text)
    if reason is None:
        log.warning("the scheduler answered with a reason this gateway does not know: %r", text)
    return reason
