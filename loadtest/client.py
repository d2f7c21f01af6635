"""Streaming OpenAI-compatible client: one POST per request, timing every SSE event as it arrives.

Works with any server speaking OpenAI's `/v1/completions` or `/v1/chat/completions` with `stream=true`
(Baton's gateway, vLLM, SGLang, TGI, OpenAI itself). Client: `aiohttp`, as in vLLM's
benchmark_serving -- one connection pool, no retries, no proxies from the environment, bytes read as
they arrive (`iter_any`) and parsed by our own SSE parser. The `openai` SDK was not used: it retries
429/5xx on its own (which would hide rejections and inflate TTFT) and its pydantic parsing per chunk
costs client CPU that shows up as latency at high concurrency.

Timing (`time.perf_counter`): `t0` is taken just before the request is handed to aiohttp, so TTFT
includes opening a connection when the pool has no idle one (as a real client's would). Each network
read is timestamped once; every event parsed from that read gets that time. TTFT is `t0` -> the first
event carrying non-empty `text` / `delta.content` / `delta.reasoning_content` -- a chat stream's first
`{"role": "assistant", "content": ""}` chunk is NOT a token and does not stop the TTFT clock.

Token counts: `stream_options.include_usage` is sent (disable with `include_usage=False` for servers
that reject it); when the final usage chunk arrives, `usage.completion_tokens` is the count
(`TokenSource.USAGE`). Otherwise the streamed text is counted with the harness's engine tokenizer
(`TOKENIZER`) or, with only a word approximation at hand, one token per content chunk (`CHUNKS`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.records import ErrorKind, Message, RequestRecord, TokenSource
from loadtest.sse import SSEParser
from loadtest.tokens import PromptTokenizer

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None  # sent as "Authorization: Bearer KEY"
    request_timeout: float = 300.0  # seconds for the whole request, stream included
    include_usage: bool = True  # send stream_options.include_usage
    ignore_eos: bool = False  # vLLM/Baton extension: generate exactly max_tokens
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every payload

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; valid: {', '.join(ENDPOINTS)}")

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class _Stream:
    """What one response stream has shown so far."""

    first: float | None = None  # time of the first content event
    last: float | None = None  # time of the latest content event
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False  # [DONE] seen
    end: float | None = None  # time of the last event (the [DONE] one when there is one)


class OpenAIStreamClient:
    """Use as `async with OpenAIStreamClient(config, tokenizer) as c: await c.send(...)`. Not thread-safe;
    one instance per event loop. `send` never raises for a failed request: the record says why."""

    def __init__(self, config: ClientConfig, tokenizer: PromptTokenizer | None = None) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._session: aiohttp.ClientSession | None = None
        self.model = config.model

    async def __aenter__(self) -> OpenAIStreamClient:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)
        if self.model is None:
            try:
                self.model = await self._first_model()
            except BaseException:
                await self._session.close()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self) -> dict[str, str]:
        # identity: a compressing proxy or server would hold tokens back to fill its compression blocks
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    async def _first_model(self) -> str:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.config.root}/v1/models", headers=self._headers()) as resp:
                resp.raise_for_status()
                return (await resp.json())["data"][0]["id"]
        except (aiohttp.ClientError, KeyError, IndexError, TimeoutError) as e:
            raise ConnectionError(f"cannot list models at {self.config.root}/v1/models; pass --model: {e}") from e

    def payload(self, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                                "temperature": self.config.temperature}
        if self.config.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = flatten_messages(messages)
        if self.config.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        return body | self.config.extra_body

    async def send(self, messages: list[Message], record: RequestRecord) -> RequestRecord:
        """POST the request, stream the answer, and fill `record` (times relative to its own send)."""
        assert self._session is not None, "use the client as an async context manager"
        url = self.config.root + ENDPOINTS[self.config.endpoint]
        body = json.dumps(self.payload(messages, record.max_tokens))
        stream = _Stream()
        t0 = time.perf_counter()
        try:
            async with self._session.post(url, data=body, headers=self._headers()) as resp:
                record.http_status = resp.status
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    return _fail(record, ErrorKind.from_status(resp.status), detail, stream, t0)
                await self._read_stream(resp, stream, t0)
        except TimeoutError:  # aiohttp's total timeout (asyncio.TimeoutError is TimeoutError on 3.11)
            return _fail(record, ErrorKind.TIMEOUT, "request timeout", stream, t0)
        except aiohttp.ClientConnectorError as e:
            return _fail(record, ErrorKind.CONNECT, str(e), stream, t0)
        except (aiohttp.ClientError, ConnectionError) as e:
            return _fail(record, ErrorKind.DISCONNECT, f"{type(e).__name__}: {e}", stream, t0)
        except _StreamError as e:
            return _fail(record, e.kind, e.detail, stream, t0)
        record.e2e = (stream.end or time.perf_counter()) - t0
        if stream.end is None:
            return _fail(record, ErrorKind.BAD_RESPONSE, "a 200 response without SSE events", stream, t0)
        if not stream.done and stream.finish_reason is None:
            return _fail(record, ErrorKind.DISCONNECT, "stream ended without [DONE]", stream, t0)
        self._finish(record, stream, t0)
        record.ok = True
        return record

    async def _read_stream(self, resp: aiohttp.ClientResponse, stream: _Stream, t0: float) -> None:
        parser = SSEParser()
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            for event in parser.feed(data):
                if not stream.done:  # read on to EOF after [DONE] so the connection can be reused
                    _on_event(event, stream, now)
        for event in parser.close():
            if not stream.done:
                _on_event(event, stream, time.perf_counter())

    def _finish(self, record: RequestRecord, stream: _Stream, t0: float) -> None:
        _copy_timing(record, stream, t0)
        usage = stream.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens, record.token_source = usage["completion_tokens"], TokenSource.USAGE
        elif self._tokenizer is not None and self._tokenizer.kind == "engine":
            record.output_tokens = self._tokenizer.count(record.output_text)
            record.token_source = TokenSource.TOKENIZER
        else:
            record.output_tokens, record.token_source = stream.chunks, TokenSource.CHUNKS
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


class _StreamError(Exception):
    def __init__(self, kind: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _on_event(data: str, stream: _Stream, now: float) -> None:
    stream.end = now
    if data.strip() == "[DONE]":
        stream.done = True
        return
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise _StreamError(ErrorKind.BAD_RESPONSE, f"bad SSE data {data[:100]!r}") from e
    if not isinstance(obj, dict):
        raise _StreamError(ErrorKind.BAD_RESPONSE, f"bad SSE data {data[:100]!r}")
    if "error" in obj:
        raise _StreamError(ErrorKind.STREAM_ERROR, json.dumps(obj["error"])[:300])
    if obj.get("usage"):
        stream.usage = obj["usage"]  # the last one wins (continuous usage stats send one per chunk)
    for choice in obj.get("choices") or []:
        text = _choice_text(choice)
        if text:
            if stream.last is not None:
                stream.gaps.append(now - stream.last)
            stream.first = now if stream.first is None else stream.first
            stream.last = now
            stream.chunks += 1
            stream.text.append(text)
        if choice.get("finish_reason"):
            stream.finish_reason = choice["finish_reason"]


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:  # /v1/completions
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _copy_timing(record: RequestRecord, stream: _Stream, t0: float) -> None:
    record.ttft = None if stream.first is None else stream.first - t0
    record.chunk_gaps = stream.gaps
    record.content_chunks = stream.chunks
    record.finish_reason = stream.finish_reason
    record.output_text = "".join(stream.text)


def _fail(record: RequestRecord, kind: ErrorKind, detail: str, stream: _Stream, t0: float) -> RequestRecord:
    _copy_timing(record, stream, t0)
    if record.e2e is None:
        record.e2e = time.perf_counter() - t0
    record.ok, record.error, record.error_detail = False, kind, detail
    record.output_tokens, record.token_source = stream.chunks, TokenSource.CHUNKS
    return record


def flatten_messages(messages: list[Message]) -> str:
    """Chat messages as one /v1/completions prompt: a lone user message is sent verbatim; a conversation
    becomes "System: ...\\n\\nUser: ...\\n\\nAssistant: ...\\n\\nAssistant:" (no model's template)."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"
