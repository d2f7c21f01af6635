"""Plain data of a benchmark: what to send (`Turn`, `Session`) and what was measured (`RequestRecord`).

All times are float seconds from `time.perf_counter()`; `RequestRecord.send_time` is relative to the
start of its run so that records from different runs line up. Lengths are tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

Message = dict[str, str]  # {"role": ..., "content": ...}


class ErrorKind(StrEnum):
    """Why a request failed. Every failure is a miss in goodput's denominator."""

    HTTP_429 = "http_429"  # rate limited / rejected by admission
    HTTP_503 = "http_503"  # overloaded / unavailable
    HTTP_4XX = "http_4xx"  # any other client error (bad request, auth...)
    HTTP_5XX = "http_5xx"  # any other server error
    TIMEOUT = "timeout"  # no complete response within --request-timeout
    CONNECT = "connect"  # connection refused / reset before any response
    DISCONNECT = "disconnect"  # the stream ended without [DONE] or a finish_reason
    STREAM_ERROR = "stream_error"  # an {"error": ...} event inside a 200 stream
    BAD_RESPONSE = "bad_response"  # unparseable SSE data
    SKIPPED = "skipped"  # a later turn of a conversation whose earlier turn failed (never sent)

    @classmethod
    def from_status(cls, status: int) -> ErrorKind:
        if status == 429:
            return cls.HTTP_429
        if status == 503:
            return cls.HTTP_503
        return cls.HTTP_4XX if status < 500 else cls.HTTP_5XX


class TokenSource(StrEnum):
    """Where a request's output token count came from."""

    USAGE = "usage"  # the server's `usage.completion_tokens` (stream_options.include_usage): exact
    TOKENIZER = "tokenizer"  # the harness tokenized the streamed text (exact only for the same model)
    CHUNKS = "chunks"  # one token per content-bearing SSE chunk (an approximation)


@dataclass(frozen=True)
class Turn:
    """One request to send. For a multi-turn session, `messages` holds only this turn's new user
    message; the runner prepends the conversation so far (system prompt, earlier turns, answers)."""

    messages: tuple[Message, ...]
    prompt_len: int  # tokens of the new content, by the dataset's tokenizer (see `tokenizer_kind`)
    output_len: int  # sent as max_tokens


@dataclass(frozen=True)
class Session:
    """Turns sent one after another on one conversation; sessions run concurrently."""

    session_id: int
    turns: tuple[Turn, ...]
    system_prompt: str | None = None  # shared between sessions in prefix-cache workloads
    system_prompt_len: int = 0  # its tokens, by the dataset's tokenizer


@dataclass
class RequestRecord:
    """What the client measured for one request. `ttft`/`e2e` are None when unknown (failed early)."""

    request_id: str
    session_id: int
    turn: int
    send_time: float  # seconds since the run started
    prompt_len: int  # the harness's count of the whole prompt sent (all turns so far)
    max_tokens: int
    ok: bool = False
    error: ErrorKind | None = None
    error_detail: str = ""
    http_status: int | None = None
    ttft: float | None = None  # send -> first chunk carrying content
    e2e: float | None = None  # send -> end of the stream ([DONE] or close)
    chunk_gaps: list[float] = field(default_factory=list)  # between consecutive content chunks
    content_chunks: int = 0
    output_tokens: int = 0
    token_source: TokenSource | None = None
    prompt_tokens: int | None = None  # server's usage.prompt_tokens, when reported
    cached_tokens: int | None = None  # server's usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    output_text: str = ""

    def to_json(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["chunk_gaps"] = [round(g, 6) for g in self.chunk_gaps]
        if not keep_text:
            d.pop("output_text")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        d = dict(d)
        d["error"] = ErrorKind(d["error"]) if d.get("error") else None
        d["token_source"] = TokenSource(d["token_source"]) if d.get("token_source") else None
        return cls(**d)
