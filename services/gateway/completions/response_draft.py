"""`ResponseDraft`: one Responses API `response` object as it is built from chat completion chunks (or
a whole chat completion), and what each finish reason makes of its status.

Its `output` holds a `message` item (the text) and one `function_call` item per tool call. The message
is there when there is text or no call at all; it comes first unless its text came after the calls
(the unparsed rest of a call cut by max_output_tokens), so the streamed `output_index`es and the final
`output` agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.schemas import ResponsesNamedToolChoice, ResponsesRequest
from tokenization.finish_reason import FinishReason

Body = dict[str, Any]
RESPONSE_ID_PREFIX = "resp_"


@dataclass
class ResponseDraft:
    """One response as it is built; `body()` is the `response` object at any point."""

    request: ResponsesRequest
    response_id: str
    stored: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    calls: list[Body] = field(default_factory=list)  # chat `tool_calls` entries: {"id", "function": {...}}
    message_after_calls: bool = False  # the text began after the first call
    status: str = "in_progress"
    usage: Body | None = None
    incomplete: str | None = None
    error: Body | None = None  # {"code", "message"} once the worker failed mid-stream

    @property
    def item_id(self) -> str:
        return "msg_" + self.response_id.removeprefix(RESPONSE_ID_PREFIX)

    @property
    def has_message(self) -> bool:
        return bool(self.text) or not self.calls

    def part(self) -> Body:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def item(self, status: str) -> Body:
        content = [self.part()] if status == "completed" or self.text else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def call_item(self, index: int, status: str = "completed") -> Body:
        call = self.calls[index]
        return {"id": f"fc_{self.response_id.removeprefix(RESPONSE_ID_PREFIX)}_{index}", "type": "function_call",
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}

    def message_index(self) -> int:
        return len(self.calls) if self.message_after_calls else 0

    def call_index(self, index: int) -> int:
        """The `output_index` of call `index`."""
        return index + (1 if self.text and not self.message_after_calls else 0)

    def output(self) -> list[Body]:
        items = [self.call_item(i) for i in range(len(self.calls))]
        if self.has_message:
            items.insert(self.message_index(), self.item("completed"))
        return items

    def body(self) -> Body:
        r = self.request
        done = self.status != "in_progress"
        choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, ResponsesNamedToolChoice) else r.tool_choice
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": r.model, "instructions": r.instructions, "previous_response_id": r.previous_response_id,
            "store": self.stored, "output": self.output() if done else [],
            "usage": self.usage, "error": self.error, "metadata": r.metadata or {},
            "incomplete_details": {"reason": self.incomplete} if self.incomplete else None,
            "max_output_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
            "parallel_tool_calls": r.parallel_tool_calls, "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()], "text": {"format": {"type": "text"}},
        }

    def absorb(self, chunk: Body) -> tuple[str, FinishReason | None]:
        """Fold one chat completion chunk in: (its new text, its finish reason); an error chunk fails it.
        Its tool calls (each whole, in one delta) are appended to `calls`."""
        if "error" in chunk:
            self.status = "failed"
            self.error = {"code": chunk["error"].get("code") or "server_error",
                          "message": chunk["error"].get("message") or ""}
            return "", None
        self.usage = response_usage(chunk.get("usage")) or self.usage
        text, finish = "", None
        for choice in chunk.get("choices", []):
            text += choice["delta"].get("content") or ""
            self.calls.extend(choice["delta"].get("tool_calls") or ())
            if choice.get("finish_reason"):  # the chunk is JSON read back from the event log: a plain string
                finish = FinishReason(choice["finish_reason"])
        if text and not self.text:
            self.message_after_calls = bool(self.calls)
        self.text += text
        return text, finish

    def absorb_message(self, message: Body) -> None:
        """A whole (unstreamed) chat completion's message; text beside calls is the rest of a cut call."""
        self.calls = list(message.get("tool_calls") or ())
        self.text = message.get("content") or ""
        self.message_after_calls = bool(self.calls and self.text)

    def finish(self, finish_reason: FinishReason | None) -> None:
        if self.status == "failed":
            return
        self.status = "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
        self.incomplete = "max_output_tokens" if finish_reason == FinishReason.LENGTH else None
        if finish_reason == FinishReason.CONTENT_FILTER:
            self.status, self.incomplete = "incomplete", "content_filter"
        if finish_reason == FinishReason.ABORT:  # cancelled (or the gateway shut down under it)
            self.status = "cancelled"


def response_usage(usage: Body | None) -> Body | None:
    """Chat completion usage as the Responses API names it."""
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}
