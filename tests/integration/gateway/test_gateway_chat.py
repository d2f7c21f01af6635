"""`POST /v1/chat/completions` through the official openai SDK, against the real worker."""

from __future__ import annotations

from functools import cache

from openai import OpenAI

from tests.support.gateway_stack import MODEL, GatewayStack
from tokenization.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@cache
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def prompt_tokens(stack: GatewayStack, messages: list[dict[str, str]]) -> int:
    return len(_tokenizer(str(stack.model_dir)).encode_chat(messages))


def test_non_streaming_usage_equals_the_tokenizer_counts(client: OpenAI, stack: GatewayStack) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logprobs=True)
    choice = reply.choices[0]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt_tokens(stack, MESSAGES)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert reply.usage.completion_tokens == len(choice.logprobs.content)  # one logprob per generated token
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant" and choice.message.content


def test_streaming_matches_non_streaming_under_greedy_decoding(client: OpenAI, stack: GatewayStack) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == prompt_tokens(stack, MESSAGES)
    assert usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_n_choices_are_independent_and_reproducible_with_a_seed(client: OpenAI) -> None:
    def ask() -> list[str]:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=3, seed=1234,
                                               temperature=1.0)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert reply.usage is not None
        assert reply.usage.completion_tokens <= 3 * 8
        return [c.message.content or "" for c in reply.choices]

    first = ask()
    assert len(set(first)) > 1  # derived seeds: the choices differ
    assert ask() == first  # ... and replay identically


def test_stop_string_cuts_the_text(client: OpenAI) -> None:
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = free.choices[0].message.content or ""
    words = text.split()
    assert len(words) >= 2, text
    stop = " " + words[1]
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]


def test_top_logprobs_are_sorted_alternatives(client: OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= 0.0 and abs(entry.logprob - tops[0]) < 1e-4  # greedy picks the best
        assert bytes(entry.bytes or []).decode("utf-8", errors="replace") == entry.token
