"""The gateway's own converters for the scheduler's wire (services/gateway/routing/convert.py)."""

from __future__ import annotations

import logging

import pytest

from rpcgen.baton.v1 import scheduler_pb2 as pb
from scheduler.adapters.convert import failure_from_proto, summary_from_proto
from scheduler.types import SLO, Reason, RequestSummary, Tier, WorkerFailure
from services.gateway.routing.convert import failure_report_to_proto, reason_from_proto, summary_to_proto


def test_a_known_reason_is_read_as_the_scheduler_enum() -> None:
    assert reason_from_proto("admission_queue_timeout") is Reason.QUEUE_TIMEOUT


def test_an_answer_without_a_reason_reads_as_none() -> None:
    assert reason_from_proto("") is None


def test_a_reason_from_a_newer_scheduler_is_logged_and_read_as_none(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.gateway.routing.convert"):
        assert reason_from_proto("some_future_reason") is None
    assert "some_future_reason" in caplog.text


def test_the_scheduler_reads_back_what_the_gateway_sends() -> None:
    summary = RequestSummary("r", 64, (1, -2, 2**63), Tier.PLUS, SLO(500, 50), 32, conversation_id="c",
                             model="m", num_choices=2)
    back = summary_from_proto(summary_to_proto(summary))
    assert back.prefix_hashes == (1, 2**64 - 2, 2**63)  # signed hashes travel as uint64
    assert (back.tier, back.slo, back.max_tokens, back.conversation_id, back.num_choices) == (
        Tier.PLUS, SLO(500, 50), 32, "c", 2)


@pytest.mark.parametrize("failure", list(WorkerFailure))
def test_every_failure_report_reaches_the_scheduler_as_sent(failure: WorkerFailure) -> None:
    report = failure_report_to_proto("w:1", failure, "why")
    assert (report.worker_address, failure_from_proto(report), report.detail) == ("w:1", failure, "why")
    assert isinstance(report, pb.ReportWorkerFailureRequest)
