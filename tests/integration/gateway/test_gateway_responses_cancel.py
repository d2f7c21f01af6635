"""`POST /v1/responses/{id}/cancel` through the official openai SDK's `client.responses.cancel`, on the real
stack and a second gateway replica sharing its Redis: a streamed response in progress stops at once and
answers with status `cancelled` (from either replica), what was generated is billed once; a finished
response is a 400; an unknown id or another tenant's is a 404."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.integration.gateway.migration_checks import billed
from tests.support.gateway_stack import MODEL, GatewayStack, Tenant

ESSAY = "Write a long, detailed essay about the history of lighthouses."  # greedy output runs long
MAX_OUTPUT = 400


@pytest.fixture(scope="module")
def other_replica(gateway_stack: GatewayStack) -> Iterator[str]:
    _, url = gateway_stack.start_gateway("gateway-responses-b")
    yield url
    gateway_stack.supervisor.stop_child("gateway-responses-b")


def _stream_cancelled_after(client: OpenAI, canceller: OpenAI, deltas: int) -> tuple[list[Any], Any]:
    """Every event of a long streamed response, cancelled through `canceller` after `deltas` text deltas;
    and the cancel's answer."""
    got: list[Any] = []
    answer = None
    for event in client.responses.create(model=MODEL, input=ESSAY, max_output_tokens=MAX_OUTPUT, temperature=0,
                                         stream=True):
        got.append(event)
        if answer is None and sum(e.type == "response.output_text.delta" for e in got) == deltas:
            answer = canceller.responses.cancel(got[0].response.id)
    assert answer is not None, "the stream ended before the cancel"
    return got, answer


def _check_cancelled(stack: GatewayStack, got: list[Any], answer: Any) -> None:
    final = got[-1]
    assert final.type == "response.cancelled" and final.response["status"] == "cancelled"
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert answer.status == "cancelled" and answer.id == got[0].response.id
    assert answer.output_text == text == final.response["output"][0]["content"][0]["text"]
    assert answer.usage is not None and answer.usage.output_tokens == final.response["usage"]["output_tokens"]
    assert 3 <= answer.usage.output_tokens < MAX_OUTPUT // 4  # stopped at once, not run to the end
    assert billed(stack, answer.id) == [(answer.usage.input_tokens, answer.usage.output_tokens)]


def test_a_streamed_response_cancelled_stops_at_once_and_answers_cancelled(
        stack: GatewayStack, client: OpenAI) -> None:
    got, answer = _stream_cancelled_after(client, client, 3)
    _check_cancelled(stack, got, answer)
    assert answer.model == MODEL and answer.max_output_tokens == MAX_OUTPUT  # the request's fields, echoed


def test_a_cancel_through_another_replica_stops_the_stream_where_it_runs(
        stack: GatewayStack, tenant: Tenant, client: OpenAI, other_replica: str) -> None:
    with OpenAI(base_url=f"{other_replica}/v1", api_key=tenant.key, max_retries=0, timeout=60) as elsewhere:
        got, answer = _stream_cancelled_after(client, elsewhere, 3)
    _check_cancelled(stack, got, answer)


def test_a_finished_response_cannot_be_cancelled(client: OpenAI) -> None:
    streamed = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True))
    unstreamed = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    for response_id in (streamed[-1].response.id, unstreamed.id):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.cancel(response_id)
        assert refused.value.code == "response_already_finished"


def test_an_unknown_or_another_tenants_response_is_not_found(stack: GatewayStack, client: OpenAI) -> None:
    for unknown in ("resp_" + uuid.uuid4().hex, "resp_not-hex", "chatcmpl-nothing"):
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel(unknown)
    with stack.openai(stack.tenant().key) as stranger:
        got: list[Any] = []
        for event in client.responses.create(model=MODEL, input=ESSAY, max_output_tokens=MAX_OUTPUT, temperature=0,
                                             stream=True):
            got.append(event)
            if len(got) == 5:
                with pytest.raises(openai.NotFoundError):
                    stranger.responses.cancel(got[0].response.id)
                client.responses.cancel(got[0].response.id)  # the owner's cancel still works: end it early
    assert got[-1].type == "response.cancelled"
