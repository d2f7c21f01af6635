"""The `speculative` request extension reaches the worker's SamplingParams (unset: the worker's default)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.completions.generation import SamplingSpec
from services.gateway.schemas import ChatCompletionRequest

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_speculative_draft_length_is_parsed() -> None:
    body = ChatCompletionRequest.model_validate({**BODY, "speculative": {"num_draft_tokens": 4}})
    assert body.speculative is not None and body.speculative.num_draft_tokens == 4


@pytest.mark.parametrize("k", [-1, 17])
def test_out_of_range_draft_length_is_refused(k: int) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**BODY, "speculative": {"num_draft_tokens": k}})


def test_draft_length_crosses_to_the_worker_proto_and_unset_stays_unset() -> None:
    assert SamplingSpec(max_tokens=8, num_draft_tokens=0).to_proto().num_draft_tokens == 0
    assert SamplingSpec(max_tokens=8, num_draft_tokens=0).to_proto().HasField("num_draft_tokens")
    assert not SamplingSpec(max_tokens=8).to_proto().HasField("num_draft_tokens")
