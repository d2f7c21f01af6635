"""What the client sends and gets back: plain dataclasses, converted from and to the API's messages here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import grpc
from google.rpc import error_details_pb2, status_pb2

from rpcgen.baton.v1 import api_pb2 as pb


class Role(StrEnum):
    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class Message:
    role: Role
    content: str
    name: str = ""
    tool_call_id: str = ""  # tool turns: the call this message answers

    def to_proto(self) -> pb.ChatMessage:
        return pb.ChatMessage(role=self.role.value, content=self.content, name=self.name,
                              tool_call_id=self.tool_call_id)


@dataclass(frozen=True)
class Sampling:
    """None: the gateway's default (as in the HTTP API)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: int | None = None  # k: each token's logprob and its top-k alternatives

    def to_proto(self) -> pb.SamplingOptions:
        msg = pb.SamplingOptions(stop=list(self.stop), presence_penalty=self.presence_penalty,
                                 frequency_penalty=self.frequency_penalty, n=self.n)
        for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):  # unset: the gateway's default
            if getattr(self, name) is not None:
                setattr(msg, name, getattr(self, name))
        return msg


class Finish(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"  # refused or halted by the content policy: see Choice.refusal
    TOOL_CALLS = "tool_calls"
    ABORT = "abort"
    ERROR = "error"


_FINISH = {pb.COMPLETION_FINISH_STOP: Finish.STOP, pb.COMPLETION_FINISH_LENGTH: Finish.LENGTH,
           pb.COMPLETION_FINISH_CONTENT_FILTER: Finish.CONTENT_FILTER,
           pb.COMPLETION_FINISH_TOOL_CALLS: Finish.TOOL_CALLS, pb.COMPLETION_FINISH_ABORT: Finish.ABORT,
           pb.COMPLETION_FINISH_ERROR: Finish.ERROR}


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    raw: bytes = b""  # the token's bytes (chat only)
    top: tuple[tuple[str, float], ...] = ()  # the alternatives: (token, logprob)

    @classmethod
    def from_proto(cls, msg: pb.TextLogprob) -> TokenLogprob:
        return cls(msg.token, msg.logprob, msg.raw, tuple((t.token, t.logprob) for t in msg.top))


@dataclass(frozen=True)
class Choice:
    """One choice: in a `Chunk` its new text, in a `Completion` all of it."""

    index: int
    text: str
    finish: Finish | None = None  # None: still running
    refusal: str | None = None  # why the content policy refused or halted it
    logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.ChoiceDelta) -> Choice:
        return cls(msg.index, msg.text, _FINISH.get(msg.finish), msg.refusal or None,
                   tuple(TokenLogprob.from_proto(lp) for lp in msg.logprobs))

    def then(self, delta: Choice) -> Choice:
        return Choice(self.index, self.text + delta.text, delta.finish or self.finish,
                      delta.refusal or self.refusal, self.logprobs + delta.logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Chunk:
    """One streamed message; the last one has no choices and carries the usage."""

    id: str
    model: str
    choices: tuple[Choice, ...]
    usage: Usage | None = None
    conversation_id: str | None = None

    @classmethod
    def from_proto(cls, msg: pb.CompletionChunk) -> Chunk:
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.total_tokens,
                      msg.usage.cached_tokens) if msg.HasField("usage") else None
        return cls(msg.id, msg.model, tuple(Choice.from_proto(c) for c in msg.choices), usage,
                   msg.conversation_id or None)

    @property
    def text(self) -> str:
        """The first choice's new text (the only one unless n > 1)."""
        return next((c.text for c in self.choices if c.index == 0), "")


@dataclass(frozen=True)
class Completion:
    id: str
    model: str
    choices: tuple[Choice, ...]
    usage: Usage | None
    conversation_id: str | None = None

    @classmethod
    def collect(cls, chunks: Iterable[Chunk]) -> Completion:
        """A whole stream, its deltas joined per choice."""
        first: Chunk | None = None
        choices: dict[int, Choice] = {}
        usage = None
        for chunk in chunks:
            first = first or chunk
            for delta in chunk.choices:
                previous = choices.get(delta.index)
                choices[delta.index] = delta if previous is None else previous.then(delta)
            usage = chunk.usage or usage
        if first is None:
            raise BatonApiError(grpc.StatusCode.INTERNAL, "the stream ended without a message", "empty_stream")
        return cls(first.id, first.model, tuple(choices[i] for i in sorted(choices)), usage, first.conversation_id)

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def finish(self) -> Finish | None:
        return self.choices[0].finish if self.choices else None


@dataclass
class BatonApiError(Exception):
    """A call failed: its gRPC status, Baton's error code (as the HTTP API names it), the field at fault
    and, when waiting helps, how long to wait."""

    status: grpc.StatusCode
    message: str
    code: str
    param: str | None = None
    retry_after_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message} ({self.code})"

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> BatonApiError:
        pairs = [(k, v) for k, v in (error.trailing_metadata() or ())]  # type: ignore[attr-defined]
        text = {k: v for k, v in pairs if isinstance(v, str)}
        details = next((v for k, v in pairs if k == "grpc-status-details-bin"), None)
        return cls(error.code(), error.details() or "", text.get("baton-error-code", ""),  # type: ignore[attr-defined]
                   text.get("baton-error-param"), retry_delay(details), text)


def retry_delay(details: bytes | str | None) -> float | None:
    """The google.rpc.RetryInfo delay in the status details, if the server sent one."""
    if not isinstance(details, bytes):
        return None
    status = status_pb2.Status.FromString(details)
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None
