"""OpenAI response bodies, chunk by chunk: chat (`chat.completion[.chunk]`) and text (`text_completion`).

Two formatter classes with the same methods, chosen per route (a policy object, not `if chat:` in the
pipeline). They turn the runner's plain results into dicts; `json_data` serializes a chunk for SSE.

Usage in responses follows OpenAI: `prompt_tokens` counts each distinct prompt once even when n > 1
(billing records each of the n generations as its own request; see docs/operations.md),
`completion_tokens` sums every choice, `prompt_tokens_details.cached_tokens` is what the prefix
cache served for the first choice of each prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.gateway.completions.generation import TokenLogprob
from services.gateway.completions.run_state import ChoiceEvent, ChoiceState
from services.gateway.completions.tools import ToolCallParser, ToolPlan
from tokenization.finish_reason import FinishReason
from tokenization.tokenizer import Tokenizer

Body = dict[str, Any]


def json_data(body: Body) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte maps to one printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """A token id's text and exact bytes (a byte-level token may hold part of a UTF-8 character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._compute)

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._tokenizer.convert_ids_to_tokens([token_id])[0] or ""
        if piece and all(c in _BYTE_OF_CHAR for c in piece):
            raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        else:  # special tokens and non-byte-level vocabularies
            raw = self._tokenizer.decode([token_id]).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), tuple(raw)


@dataclass(frozen=True)
class ResponseMeta:
    completion_id: str
    created: int
    model: str
    n: int  # choices per prompt
    include_usage: bool = False
    echo_prompts: tuple[str, ...] = ()  # text completions with echo=True: prepended to each choice
    conversation_id: str | None = None


def usage_body(states: Sequence[ChoiceState], n: int) -> Body:
    firsts = [s for s in states if s.spec.index % n == 0]
    prompt = sum(s.prompt_tokens for s in firsts)
    cached = sum(s.cached_tokens for s in firsts)
    completion = sum(len(s.token_ids) for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class ChatFormatter:
    """`tools`: the request's tool plan; each choice's text then goes through a `ToolCallParser`, and
    calls come out as `tool_calls` (streamed: one delta per call as it completes) with finish reason
    `tool_calls`."""

    object_name = "chat.completion"

    def __init__(self, meta: ResponseMeta, tokens: TokenTexts, tools: ToolPlan | None = None) -> None:
        self.meta = meta
        self.tokens = tokens
        self.tools = tools
        self._started: set[int] = set()
        self._parsers: dict[int, ToolCallParser] = {}

    def _head(self, obj: str) -> Body:
        m = self.meta
        head: Body = {"id": m.completion_id, "object": obj, "created": m.created, "model": m.model,
                      "system_fingerprint": None}
        if m.conversation_id:
            head["conversation_id"] = m.conversation_id
        return head

    def _logprobs(self, items: Sequence[TokenLogprob]) -> Body:
        def entry(token_id: int, logprob: float) -> Body:
            text, raw = self.tokens.get(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}
        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in items], "refusal": None}

    def chunk(self, event: ChoiceEvent) -> Body:
        text, finish, calls_delta = event.text, event.finish_reason, None
        if self.tools is not None:
            parser = self._parsers.setdefault(event.index, self.tools.parser())
            before = len(parser.calls)
            text, calls = parser.feed(event.text, final=finish is not None)
            if calls:
                calls_delta = [c.body(before + i) for i, c in enumerate(calls)]
            if finish == FinishReason.STOP and parser.calls:
                finish = FinishReason.TOOL_CALLS
        delta: Body = {"content": text if text or not calls_delta else None}
        if event.index not in self._started:
            self._started.add(event.index)
            delta = {"role": "assistant"} | delta
        if calls_delta:
            delta["tool_calls"] = calls_delta
        if event.refusal:
            delta["refusal"] = event.refusal
        choice = {"index": event.index, "delta": delta,
                  "logprobs": self._logprobs(event.logprobs) if event.logprobs else None,
                  "finish_reason": finish}
        body = self._head("chat.completion.chunk") | {"choices": [choice]}
        if self.meta.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, states: Sequence[ChoiceState]) -> Body:
        return self._head("chat.completion.chunk") | {"choices": [], "usage": usage_body(states, self.meta.n)}

    def response(self, states: Sequence[ChoiceState], want_logprobs: bool) -> Body:
        choices = []
        for s in states:
            message = self._message(s)
            called = message.get("tool_calls") and s.finish_reason == FinishReason.STOP
            finish = FinishReason.TOOL_CALLS if called else s.finish_reason
            choices.append({"index": s.spec.index, "message": message,
                            "logprobs": self._logprobs(s.logprobs) if want_logprobs else None,
                            "finish_reason": finish})
        return self._head(self.object_name) | {"choices": choices, "usage": usage_body(states, self.meta.n)}

    def _message(self, state: ChoiceState) -> Body:
        message: Body = {"role": "assistant", "content": state.text, "refusal": state.refusal}
        if self.tools is not None and state.refusal is None:
            content, calls = self.tools.parser().parse(state.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [c.body() for c in calls]
        return message


class TextFormatter:
    object_name = "text_completion"

    def __init__(self, meta: ResponseMeta, tokens: TokenTexts) -> None:
        self.meta = meta
        self.tokens = tokens
        self._started: set[int] = set()

    def _head(self) -> Body:
        m = self.meta
        return {"id": m.completion_id, "object": self.object_name, "created": m.created, "model": m.model,
                "system_fingerprint": None}

    def _logprobs(self, items: Sequence[TokenLogprob], offset: int = 0) -> Body:
        tokens, logprobs, tops, offsets = [], [], [], []
        for lp in items:
            text, _ = self.tokens.get(lp.token_id)
            tokens.append(text)
            logprobs.append(lp.logprob)
            tops.append({self.tokens.get(t)[0]: p for t, p in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self, index: int) -> str:
        prompts = self.meta.echo_prompts
        return prompts[index // self.meta.n] if prompts else ""

    def chunk(self, event: ChoiceEvent) -> Body:
        text = event.text
        if event.index not in self._started:
            self._started.add(event.index)
            text = self._echo(event.index) + text
        choice = {"index": event.index, "text": text,
                  "logprobs": self._logprobs(event.logprobs) if event.logprobs else None,
                  "finish_reason": event.finish_reason}
        body = self._head() | {"choices": [choice]}
        if self.meta.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, states: Sequence[ChoiceState]) -> Body:
        return self._head() | {"choices": [], "usage": usage_body(states, self.meta.n)}

    def response(self, states: Sequence[ChoiceState], want_logprobs: bool) -> Body:
        choices = [{"index": s.spec.index, "text": self._echo(s.spec.index) + s.text,
                    "logprobs": self._logprobs(s.logprobs) if want_logprobs else None,
                    "finish_reason": s.finish_reason} for s in states]
        return self._head() | {"choices": choices, "usage": usage_body(states, self.meta.n)}


Formatter = ChatFormatter | TextFormatter
