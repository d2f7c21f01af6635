"""`POST /v1/completions` (text) through the openai SDK."""

from __future__ import annotations

from openai import OpenAI

from tests.support.gateway_stack import MODEL, GatewayStack
from tokenization.tokenizer import Tokenizer

PROMPT = "The capital of France is"


def test_text_completion_counts_the_prompt_like_the_tokenizer(client: OpenAI, stack: GatewayStack) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    tokenizer = Tokenizer.from_dir(stack.model_dir)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == reply.usage.completion_tokens
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_streamed_text_equals_the_whole_reply(client: OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text


def test_token_id_prompts_and_echo(client: OpenAI, stack: GatewayStack) -> None:
    ids = Tokenizer.from_dir(stack.model_dir).encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text


def test_several_prompts_give_one_choice_each(client: OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text != reply.choices[1].text
