"""Why a choice ended: one vocabulary from the engine to the API's `finish_reason`.

The engine ends a sequence with STOP, LENGTH, ABORT or ERROR; the gateway adds the two endings only it decides,
CONTENT_FILTER and TOOL_CALLS. The enum lives on this torch-free ground floor because the engine and the gateway
both speak it and neither may import the other (docs/architecture.md, import rules).
"""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # the engine failed the request (e.g. KV integrity check)
    CONTENT_FILTER = "content_filter"  # gateway only: the safety filter halted the stream or refused the prompt
    TOOL_CALLS = "tool_calls"  # gateway only: the text parsed as tool calls (reported instead of STOP)
