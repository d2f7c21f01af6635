"""The completion's stream chunks (the HTTP API's `chat.completion.chunk` / `text_completion` bodies,
as the formatters wrote them into the event log) -> `CompletionChunk` messages.

The event log is the one place a streamed completion is produced, for SSE and for gRPC alike, so the
gRPC edge reads the same chunks the SSE edge sends; this module only changes their shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rpcgen.baton.v1 import api_pb2 as pb
from tokenization.finish_reason import FinishReason

Body = Mapping[str, Any]
FINISH_TO_PROTO = {
    None: pb.COMPLETION_FINISH_UNSPECIFIED,
    FinishReason.STOP: pb.COMPLETION_FINISH_STOP,
    FinishReason.LENGTH: pb.COMPLETION_FINISH_LENGTH,
    FinishReason.CONTENT_FILTER: pb.COMPLETION_FINISH_CONTENT_FILTER,
    FinishReason.TOOL_CALLS: pb.COMPLETION_FINISH_TOOL_CALLS,
    FinishReason.ABORT: pb.COMPLETION_FINISH_ABORT,
    FinishReason.ERROR: pb.COMPLETION_FINISH_ERROR,
}


def chunk_from_body(body: Body) -> pb.CompletionChunk:
    chunk = pb.CompletionChunk(id=body["id"], model=body["model"], created=body["created"],
                               conversation_id=body.get("conversation_id") or "",
                               choices=[_choice(c) for c in body["choices"]])
    usage = body.get("usage")
    if usage:
        chunk.usage.CopyFrom(pb.Usage(
            prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
            total_tokens=usage["total_tokens"],
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
    return chunk


def _choice(choice: Body) -> pb.ChoiceDelta:
    delta = choice.get("delta")
    if delta is not None:  # chat
        text, refusal = delta.get("content") or "", delta.get("refusal") or ""
        logprobs = _chat_logprobs(choice["logprobs"]["content"]) if choice.get("logprobs") else []
    else:  # text completion
        text, refusal = choice["text"], ""
        logprobs = _text_logprobs(choice["logprobs"]) if choice.get("logprobs") else []
    return pb.ChoiceDelta(index=choice["index"], text=text, finish=FINISH_TO_PROTO[choice["finish_reason"]],
                          refusal=refusal, logprobs=logprobs)


def _chat_logprobs(content: Sequence[Body]) -> list[pb.TextLogprob]:
    return [pb.TextLogprob(token=e["token"], logprob=e["logprob"], raw=bytes(e["bytes"]),
                           top=[pb.TextAlternative(token=t["token"], logprob=t["logprob"])
                                for t in e["top_logprobs"]])
            for e in content]


def _text_logprobs(logprobs: Body) -> list[pb.TextLogprob]:
    return [pb.TextLogprob(token=token, logprob=logprob,
                           top=[pb.TextAlternative(token=t, logprob=p) for t, p in top.items()])
            for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                           strict=True)]
