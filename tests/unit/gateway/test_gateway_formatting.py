"""OpenAI body shapes: exact token bytes, usage with n > 1, the role only on a choice's first chunk."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from services.gateway.completions.formatting import ChatFormatter, ResponseMeta, TokenTexts, usage_body
from services.gateway.completions.generation import SamplingSpec, TokenLogprob
from services.gateway.completions.prompt import PreparedPrompt
from services.gateway.completions.run_state import ChoiceEvent, ChoiceSpec, ChoiceState
from tokenization.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_token_bytes_are_exact_even_for_part_of_a_character(tokenizer: Tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("café ☃", add_special_tokens=False)
    raw = b"".join(bytes(texts.get(i)[1]) for i in ids)
    assert raw == "café ☃".encode()
    assert texts.get(tokenizer.encode(" the", add_special_tokens=False)[0])[0] == " the"


def _state(index: int, prompt: int, cached: int, completion: int) -> ChoiceState:
    spec = ChoiceSpec(index, f"r{index}", PreparedPrompt(list(range(prompt)), 8, [], ""), SamplingSpec(8))
    state = ChoiceState(spec)
    state.cached_tokens, state.token_ids = cached, list(range(completion))
    return state


def test_usage_counts_each_prompt_once_and_every_completion() -> None:
    states = [_state(0, 10, 0, 3), _state(1, 10, 10, 5), _state(2, 7, 0, 1), _state(3, 7, 7, 2)]
    assert usage_body(states, n=2) == {"prompt_tokens": 17, "completion_tokens": 11, "total_tokens": 28,
                                       "prompt_tokens_details": {"cached_tokens": 0}}


def test_the_role_comes_with_each_choices_first_chunk_only(tokenizer: Tokenizer) -> None:
    formatter = ChatFormatter(ResponseMeta("id", 0, "m", 2, include_usage=True), TokenTexts(tokenizer))
    first = formatter.chunk(ChoiceEvent(0, "Hi"))
    second = formatter.chunk(ChoiceEvent(0, " there", logprobs=(TokenLogprob(5, -0.5, ((5, -0.5),)),)))
    other = formatter.chunk(ChoiceEvent(1, "Yo"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert second["choices"][0]["delta"] == {"content": " there"}
    assert second["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert other["choices"][0]["delta"]["role"] == "assistant"
    assert first["usage"] is None


def test_prices_are_plain_numbers() -> None:
    from services.billing.pricing import ModelPrice
    from services.gateway.config import ServedModel
    from services.gateway.routes.models import model_object

    body = model_object(ServedModel("m", Path("."), 100, ModelPrice(Decimal("0.1"), Decimal("0.05"), Decimal("1"))))
    assert body["pricing"] == {"currency": "USD", "unit": "1K tokens", "input": 0.1, "cached_input": 0.05,
                               "output": 1.0}
