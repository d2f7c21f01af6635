"""Prompt building: the context window is checked before any worker call; the truncation policy."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from services.billing.pricing import ModelPrice
from services.gateway.completions.prompt import PromptBuilder
from services.gateway.config import ServedModel
from services.gateway.errors import BadRequestError, ContextWindowError
from tokenization.tokenizer import Tokenizer

PRICE = ModelPrice(Decimal(0), Decimal(0), Decimal(0))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _builder(tokenizer: Tokenizer, window: int, default_max_tokens: int = 16) -> PromptBuilder:
    return PromptBuilder(tokenizer, ServedModel("m", Path("."), window, PRICE), 16, default_max_tokens)


def _turns(n: int, words: int = 40) -> list[dict[str, str]]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"question {i} " + "word " * words},
                {"role": "assistant", "content": f"answer {i}"}]
    return out


def test_the_prompt_is_the_chat_template_tokenized(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    prompt = _builder(tokenizer, 2048).chat(messages, 10)
    assert prompt.token_ids == tokenizer.encode_chat(messages)
    assert prompt.max_tokens == 10
    assert len(prompt.prefix_hashes) == len(prompt.token_ids) // 16


def test_too_long_names_the_limit_and_the_count(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(ContextWindowError) as e:
        _builder(tokenizer, 256).chat(messages, 10)
    n = len(tokenizer.encode_chat(messages))
    assert e.value.prompt_tokens == n
    assert "maximum context length is 256 tokens" in str(e.value) and f"({n} in the prompt, 10 for" in str(e.value)


def test_without_max_tokens_the_completion_gets_what_is_left_up_to_the_default(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    n = len(tokenizer.encode_chat(messages))
    assert _builder(tokenizer, 2048, default_max_tokens=100).chat(messages, None).max_tokens == 100
    assert _builder(tokenizer, n + 5, default_max_tokens=100).chat(messages, None).max_tokens == 5


def test_history_keeps_the_system_prompt_and_the_newest_turns_that_fit(tokenizer: Tokenizer) -> None:
    system = [{"role": "system", "content": "You are terse."}]
    history = system + _turns(10)
    new = [{"role": "user", "content": "and now?"}]
    prompt = _builder(tokenizer, 400).chat(new, 50, history)
    kept = len(history) - 1 - prompt.dropped_messages
    expected = system + history[1 + prompt.dropped_messages:] + new
    assert prompt.token_ids == tokenizer.encode_chat(expected)
    assert len(prompt.token_ids) + 50 <= 400
    assert prompt.dropped_messages % 2 == 0 and kept >= 2  # cut at a user turn; the newest turns stay
    one_more = system + history[prompt.dropped_messages - 1:] + new
    assert len(tokenizer.encode_chat(one_more)) + 50 > 400  # ... and no older turn would have fit


def test_history_that_fits_is_kept_whole(tokenizer: Tokenizer) -> None:
    history = _turns(2, words=3)
    prompt = _builder(tokenizer, 2048).chat([{"role": "user", "content": "x"}], 10, history)
    assert prompt.dropped_messages == 0


def test_when_even_the_new_messages_do_not_fit_it_is_a_400(tokenizer: Tokenizer) -> None:
    with pytest.raises(ContextWindowError):
        _builder(tokenizer, 200).chat([{"role": "user", "content": "word " * 300}], 10, _turns(3))


def test_token_id_prompts_are_checked_against_the_vocabulary(tokenizer: Tokenizer) -> None:
    builder = _builder(tokenizer, 2048)
    assert builder.text([1, 2, 3], 4).token_ids == [1, 2, 3]
    with pytest.raises(BadRequestError, match="vocabulary"):
        builder.text([tokenizer.vocab_size], 4)
