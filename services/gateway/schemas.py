"""Request bodies of the OpenAI-compatible API, validated by pydantic (a failure is a 400 naming the field).

Responses are plain dicts built in `formatting.py`: they are produced per token and must be cheap.
Unknown fields are ignored (OpenAI clients send many optional ones); fields we cannot honour
(`suffix`, non-text content parts) are refused with a 400 rather than silently dropped.
Text that is not valid Unicode (a lone UTF-16 surrogate such as `"\ud800"`, which JSON can spell but
UTF-8 cannot) is a 400 anywhere in a body, before any field is looked at.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16  # n (times the number of prompts, for /v1/completions)
MAX_STOP = 4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Role = Literal["system", "developer", "user", "assistant", "tool"]
StopField = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    """Strict types: a value of the wrong JSON type is a 400 naming the field, never coerced (`true` is
    no max_tokens, `"yes"` no stream flag, `"1"` no number); an integer is still a valid number."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class _Body(_Strict):
    """A whole request body: its strings are checked for invalid Unicode first."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _invalid_text_at(data, "")
        if where is not None:
            raise ValueError(f"{where or 'body'} is not valid Unicode text (a lone surrogate such as \\ud800)")
        return data


def _invalid_text_at(value: Any, path: str) -> str | None:
    """The path of the first string that UTF-8 cannot encode (lone surrogates), or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _invalid_text_at(key, path) if isinstance(key, str) else None
        found = found if found is not None else _invalid_text_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool turns: the call answered

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template sees it ("developer" is OpenAI's newer name for "system")."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str = Field(default="", max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: Annotated[dict[str, str], Field()]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not v.get("name"):
            raise ValueError("tool_choice.function.name is required")
        return v


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", pattern=_FUNCTION_NAME)
    description: str = ""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculativeOptions(_Strict):
    """Baton extension: n-gram (prompt-lookup) speculative decoding for this request; the output is
    the same as without it (same greedy tokens, same sampling distribution), only faster when the
    answer copies from the prompt (summaries, edits). Unset: the worker's default."""

    num_draft_tokens: int = Field(ge=0, le=16)  # 0: off


class _GenerationFields(_Body):
    """Sampling and streaming fields common to chat and text completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopField | list[StopField] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    speculative: SpeculativeOptions | None = None
    # vLLM's sampling extensions (the engine has them all; without these fields they were dropped):
    # the end-of-sequence token does not end the generation (stop strings still do), so it runs to
    # max_tokens (benchmarks use it to fix output lengths)
    ignore_eos: bool = False
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # 1: off (HF semantics)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(default=None, max_length=64)

    @field_validator("stop")
    @classmethod
    def _stop_count(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=2048)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Baton extension: continue a stored conversation (history assembled server-side).
    conversation_id: uuid.UUID | None = Field(default=None, strict=False)  # JSON spells it as a string

    @model_validator(mode="after")
    def _storable_in_conversation(self) -> ChatCompletionRequest:
        if self.conversation_id is not None:
            _storable(self.messages)
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        """Top alternatives per token for the worker, or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_GenerationFields):
    prompt: PromptField
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: PromptField) -> PromptField:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            one_token_id_prompt = all(isinstance(p, int) for p in v)
            if not one_token_id_prompt and len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts in one request")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("a token-id prompt must not be empty")
            ids = [t for p in v for t in (p if isinstance(p, list) else [p]) if isinstance(t, int)]
            if any(t < 0 for t in ids):
                raise ValueError("token ids must be >= 0")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if not isinstance(x, int)]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def _storable(messages: list[ChatMessage]) -> None:
    # Postgres text cannot hold NUL characters: what is stored must not contain them.
    if any("\x00" in m.text() for m in messages):
        raise ValueError("messages stored in a conversation must not contain NUL characters")


class ConversationCreate(_Body):
    title: str = Field(default="", max_length=200, pattern=r"^[^\x00]*$")
    messages: list[ChatMessage] = Field(default_factory=list, max_length=256)

    @model_validator(mode="after")
    def _no_nul(self) -> ConversationCreate:
        _storable(self.messages)
        return self


class InputText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    """An earlier output's call, sent back as input (with its `FunctionCallOutputItem`)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: str = "{}"  # JSON text


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class ResponsesTool(_Strict):
    """A function tool, as the Responses API spells it (flat: no `function` object around it)."""

    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description or "", "strict": self.strict}
        return {"type": "function", "function": function | ({"parameters": self.parameters} if self.parameters else {})}


class ResponsesNamedToolChoice(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class ResponsesRequest(_Body):
    """`POST /v1/responses`: text and function tools (as in chat completions); no files or images."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=100)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    tools: list[ResponsesTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages: a run of function calls is one assistant turn with `tool_calls`, an
        output a `tool` turn."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
        return out

    def chat_tools(self) -> dict[str, Any]:
        """`tools`, `tool_choice` and `parallel_tool_calls` as a chat completion takes them."""
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            choice = {"type": "function", "function": {"name": choice.name}}  # type: ignore[assignment]
        return {"tools": [t.for_chat() for t in self.tools] if self.tools else None, "tool_choice": choice,
                "parallel_tool_calls": self.parallel_tool_calls}
