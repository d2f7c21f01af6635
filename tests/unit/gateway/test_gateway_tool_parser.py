"""Tool-call parsing at the end of an output: a call cut off by max_tokens comes back as content with
finish reason `length` (streamed and whole), never as `content: null` with no calls; whole calls still
parse, also when one only missed its closing tag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.gateway.completions.formatting import ChatFormatter, ResponseMeta, TokenTexts
from services.gateway.completions.generation import SamplingSpec
from services.gateway.completions.prompt import PreparedPrompt
from services.gateway.completions.run_state import ChoiceEvent, ChoiceSpec, ChoiceState
from services.gateway.completions.tools import ToolFamily, ToolPlan
from services.gateway.schemas import ToolDefinition
from tokenization.tokenizer import Tokenizer

WEATHER = ToolDefinition.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"type": "json",'  # seen from the default model
WHOLE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _plan(family: ToolFamily = ToolFamily.HERMES) -> ToolPlan:
    return ToolPlan(family, (WEATHER,), "auto", parallel=True)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _state(text: str, finish: str) -> ChoiceState:
    state = ChoiceState(ChoiceSpec(0, "r0", PreparedPrompt([1, 2], 24, [], ""), SamplingSpec(24)))
    state.text_parts, state.token_ids = [text], list(range(24))
    state.finish(finish)
    return state


def test_a_call_cut_off_by_max_tokens_is_returned_as_content(tokenizer: Tokenizer) -> None:
    formatter = ChatFormatter(ResponseMeta("id", 0, "m", 1), TokenTexts(tokenizer), _plan())
    choice = formatter.response([_state(CUT, "length")], want_logprobs=False)["choices"][0]
    assert choice["message"]["content"] == CUT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_a_streamed_call_cut_off_by_max_tokens_ends_with_its_text_as_content(tokenizer: Tokenizer) -> None:
    formatter = ChatFormatter(ResponseMeta("id", 0, "m", 1), TokenTexts(tokenizer), _plan())
    pieces = [CUT[i:i + 7] for i in range(0, len(CUT), 7)]
    chunks = [formatter.chunk(ChoiceEvent(0, p, finish_reason="length" if i == len(pieces) - 1 else None))
              for i, p in enumerate(pieces)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == CUT
    assert not any("tool_calls" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_whole_call_then_a_cut_one_gives_the_call_and_the_rest_as_content() -> None:
    content, calls = _plan().parser().parse(WHOLE + "\n" + CUT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert content is not None and content.strip() == CUT


def test_a_whole_call_missing_only_its_closing_tag_is_a_call() -> None:
    content, calls = _plan().parser().parse(WHOLE.removesuffix("</tool_call>"))
    assert content is None and [c.name for c in calls] == ["get_weather"]


def test_a_cut_llama3_call_is_returned_as_content() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Pa'
    assert _plan(ToolFamily.LLAMA3).parser().parse(text) == (text, [])
    content, calls = _plan(ToolFamily.LLAMA3).parser().parse('{"name": "get_weather", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather"]
