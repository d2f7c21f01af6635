"""A remote prefill's order crosses the Prefill RPC unchanged, and a malformed one is refused."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from rpcgen.baton.v1 import worker_pb2 as pb
from services.worker.prefill_order import PrefillOrder

ORDER = PrefillOrder("req-1@2", 2, [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, seed=4),
                     (11, 3), 0, "decode-agent-1", 4.5, "00-abc-def-01")


def test_an_order_round_trips_through_the_prefill_request() -> None:
    msg = ORDER.to_proto()
    assert PrefillOrder.from_proto(pb.PrefillRequest.FromString(msg.SerializeToString()), ORDER.traceparent) == ORDER


def test_an_order_without_a_request_id_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="request_id is empty"):
        PrefillOrder.from_proto(pb.PrefillRequest(prompt_token_ids=[1]))
