"""One finish-reason vocabulary from the engine to the API: defined once, on the ground floor."""

from __future__ import annotations

from engine.outputs import FinishReason as EngineFinishReason
from tokenization.finish_reason import FinishReason


def test_the_engine_speaks_the_ground_floor_enum() -> None:
    assert EngineFinishReason is FinishReason


def test_the_values_are_the_openai_finish_reasons() -> None:
    assert {r.value for r in FinishReason} == {"stop", "length", "abort", "error", "content_filter", "tool_calls"}
