"""Tool calling: how a chat-template family asks for tools, the grammar that makes the model's calls
valid, and the parser that turns its text back into OpenAI `tool_calls`.

Two families, chosen from the model's chat template (`family_for_template`):
- `hermes` (Hermes / Qwen / SmolLM and the default): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results come back in
  `<tool_response>` blocks of a user turn.
- `llama3` (templates that know `<|python_tag|>` / the `ipython` role): each call is
  `{"name": ..., "parameters": {...}}`, parallel calls separated by `; `, results in `ipython` turns.

The tool definitions and the history's calls and results are rendered into plain chat messages here
(a system message describing the tools, text turns for calls and results), so every template works,
including ones that have never heard of tools, such as the default model's.

Guided decoding: `ToolPlan.grammar()` is an llguidance Lark grammar whose calls embed a JSON schema
per function (the name a `const`, the arguments the function's `parameters`), so even a 135M model
can only produce calls that parse and name a real function. `auto` also allows free text (it may not
start with the call's opening character); `required` and a named function allow only calls;
`parallel_tool_calls: false` allows exactly one.
"""

from __future__ import annotations

import enum
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import BadRequestError
from services.gateway.schemas import ChatMessage, ToolDefinition

TemplateMessage = dict[str, str]


class ToolFamily(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"


def family_for_template(template: str | None) -> ToolFamily:
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return ToolFamily.LLAMA3
    return ToolFamily.HERMES


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def body(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(12)


@dataclass(frozen=True)
class ToolPlan:
    """What one request's `tools` + `tool_choice` mean for its prompt, grammar and output."""

    family: ToolFamily
    tools: tuple[ToolDefinition, ...]
    choice: str  # "auto" | "required" | a function name
    parallel: bool

    @classmethod
    def of(cls, tools: Sequence[ToolDefinition] | None, tool_choice: Any, parallel: bool,
           template: str | None) -> ToolPlan | None:
        """None when no tool can be called (no tools, or tool_choice "none")."""
        if tool_choice is not None and not tools:
            raise BadRequestError("tool_choice needs tools", "tool_choice")
        if not tools or tool_choice == "none":
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise BadRequestError("tool function names must be unique", "tools")
        choice = tool_choice if isinstance(tool_choice, str) or tool_choice is None else tool_choice.function["name"]
        choice = choice or "auto"
        if choice not in ("auto", "required") and choice not in names:
            raise BadRequestError(f"tool_choice names {choice!r}, which is not in tools ({', '.join(names)})",
                                  "tool_choice")
        return cls(family_for_template(template), tuple(tools), choice, parallel)

    # ---- prompt ---------------------------------------------------------------------------
    def system_text(self) -> str:
        specs = [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]
        if self.family is ToolFamily.LLAMA3:
            return ("You have access to the following functions. To call a function, respond with JSON in the "
                    'format {"name": function name, "parameters": dictionary of argument name and its value}. '
                    "Separate several calls with '; '. Do not use variables.\n\n"
                    + "\n\n".join(json.dumps(s) for s in specs))
        return ("You are a function calling AI model. You are provided with function signatures within "
                "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
                "Don't make assumptions about what values to plug into functions.\n<tools>\n"
                + "\n".join(json.dumps(s) for s in specs) + "\n</tools>\nFor each function call return a JSON "
                "object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def with_tools(self, messages: list[TemplateMessage]) -> list[TemplateMessage]:
        """`messages` with the tool description merged into (or put before) the system message."""
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + self.system_text()},
                    *messages[1:]]
        return [{"role": "system", "content": self.system_text()}, *messages]

    # ---- grammar --------------------------------------------------------------------------
    def grammar(self) -> str:
        """The llguidance Lark grammar the output must match (see the module docstring)."""
        functions = [t.function for t in self.tools if self.choice in ("auto", "required", t.function.name)]
        args_key = "parameters" if self.family is ToolFamily.LLAMA3 else "arguments"
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name}, args_key: f.parameters},
                             "required": ["name", args_key], "additionalProperties": False} for f in functions],
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        if self.family is ToolFamily.LLAMA3:
            call, sep, text = f"%json {json.dumps(schema)}", '"; "', r"/[^{<](.|\n)*/"
        else:
            call = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
            sep, text = r'"\n"', r"/[^<](.|\n)*/"
        # At most one call per offered function: a small model otherwise repeats its call until max_tokens.
        calls = " | ".join(" SEP ".join(["call"] * k) for k in range(1, (len(functions) if self.parallel else 1) + 1))
        start = "TEXT | calls" if self.choice == "auto" else "calls"
        return f"start: {start}\ncalls: {calls}\ncall: {call}\nSEP: {sep}\nTEXT: {text}\n"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.family)


@dataclass
class ToolCallParser:
    """One choice's output, fed as it streams: text until it is clearly tool calls, then calls.

    `feed` returns the content to pass on now and the calls completed so far (hermes calls complete at
    their closing tag; llama3 calls at the end of the output). At the end, whatever did not parse as a
    call (a call cut off by max_tokens or a stop string) comes back as content: the client gets every
    token it is billed for, as vLLM does when its tool parser fails.
    """

    family: ToolFamily
    buffer: str = ""
    mode: str = "undecided"  # undecided | text | calls
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def opener(self) -> str:
        return "<tool_call>" if self.family is ToolFamily.HERMES else "{"

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.mode == "text":
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if self.mode == "undecided":
            if head.startswith(self.opener) or head.startswith("<|python_tag|>"):
                self.mode = "calls"
            elif head and not self.opener.startswith(head) or final:
                self.mode, out, self.buffer = "text", self.buffer, ""
                return out, []
            else:
                return "", []
        found = self._extract(final)
        self.calls.extend(found)
        if not final:
            return "", found
        unparsed, self.buffer = self.buffer, ""
        return (unparsed if unparsed.strip() else ""), found

    def _extract(self, final: bool) -> list[ToolCall]:
        if self.family is ToolFamily.HERMES:
            return self._extract_hermes(final)
        if not final:
            return []
        text = self.buffer.strip().removeprefix("<|python_tag|>")
        objects, end = _json_objects(text)
        if objects:
            self.buffer = text[end:]
        return [c for c in (_call_from(obj, "parameters") for obj in objects) if c is not None]

    def _extract_hermes(self, final: bool) -> list[ToolCall]:
        found: list[ToolCall] = []
        while (end := self.buffer.find("</tool_call>")) >= 0:
            body = self.buffer[:end].strip().removeprefix("<tool_call>")
            self.buffer = self.buffer[end + len("</tool_call>"):]
            found.extend(c for c in (_call_from(o, "arguments") for o in _json_objects(body)[0]) if c is not None)
        if final and self.buffer.strip().startswith("<tool_call>"):  # cut off by max_tokens
            body = self.buffer.strip().removeprefix("<tool_call>")
            objects, end = _json_objects(body)
            calls = [c for c in (_call_from(o, "arguments") for o in objects) if c is not None]
            if calls and not body[end:].strip():  # a whole call that only missed its closing tag
                self.buffer = ""
                found.extend(calls)
        return found

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: (content or None, calls)."""
        content, calls = self.feed(text, final=True)
        return content or None, calls


def _json_objects(text: str) -> tuple[list[Any], int]:
    """The JSON objects at the start of `text` (separated by whitespace or `;`), and where they end."""
    decoder, out, i, end = json.JSONDecoder(), [], 0, 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        out.append(obj)
        end = i
    return out, end


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def history_messages(messages: Sequence[ChatMessage], family: ToolFamily) -> list[TemplateMessage]:
    """Chat messages as template messages, with tool calls and tool results spelled as the family does."""
    out: list[TemplateMessage] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": _spell_calls(m, family)})
        elif m.role == "tool" and family is ToolFamily.HERMES:
            out.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        elif m.role == "tool":
            out.append({"role": "ipython", "content": m.text()})
        else:
            out.append(m.for_template())
    return out


def _spell_calls(message: ChatMessage, family: ToolFamily) -> str:
    calls = message.tool_calls or []
    parsed = []
    for c in calls:
        try:
            args = json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError as e:
            raise BadRequestError(f"tool call arguments must be JSON: {e}", "messages") from e
        parsed.append((c.function.name, args))
    if family is ToolFamily.LLAMA3:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in parsed)
    text = "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in parsed)
    return (message.text() + "\n" + text) if message.text() else text
