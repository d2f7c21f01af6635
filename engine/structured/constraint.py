"""`GuidedDecoding`: one request's grammar constraint, carried in its `SamplingParams`.

The spec (kind + text) is what travels over gRPC. The *state* (one llguidance matcher per sequence,
keyed by request id so that n > 1 choices sharing one params object never share a parser) lives in
the same object, so it is born and dies with the request and the engine's batcher and loop need no
hook: the sampler creates a matcher on first use and, before each step's mask, feeds it the sequence's
output tokens it has not seen yet. That makes the state follow the sequence through preemption and
recompute (the output tokens are kept) without the engine telling it anything.

Grammar text is validated at creation (`InvalidRequestError`, a 400 / INVALID_ARGUMENT at the edges),
so a bad schema never reaches the engine loop.
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 64 * 1024


class GrammarKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object (response_format json_object)
    JSON_SCHEMA = "json_schema"  # a JSON schema (response_format json_schema, strict)
    LARK = "lark"  # an llguidance Lark grammar (tool calls: tags around JSON, free text or calls)


# JSON output without free whitespace: a small model otherwise tends to pad with newlines forever.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, eq=False)
class GuidedDecoding:
    kind: GrammarKind
    spec: str = ""  # the JSON schema (JSON_SCHEMA) or the Lark text (LARK); empty for JSON_OBJECT
    grammar: str = field(init=False, repr=False)  # llguidance's grammar JSON, built from kind + spec
    # Per-sequence parser state (see the module docstring); guarded by the lock because the mask is
    # computed on the sampler's mask thread while the engine thread may create another choice's state.
    states: dict[str, Any] = field(init=False, repr=False, default_factory=dict)
    lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        import llguidance  # heavy native import only where constraints are used

        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"the grammar is {len(self.spec)} characters; at most {MAX_GRAMMAR_CHARS}")
        object.__setattr__(self, "grammar", _grammar_text(self.kind, self.spec, llguidance.LLMatcher))
        error = llguidance.LLMatcher.validate_grammar(self.grammar)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {self.kind.value} constraint: {error}")


def _grammar_text(kind: GrammarKind, spec: str, matcher: Any) -> str:
    if kind is GrammarKind.LARK:
        if not spec.strip():
            raise InvalidRequestError("a lark constraint needs a grammar")
        return str(matcher.grammar_from_lark(spec))
    if kind is GrammarKind.JSON_OBJECT:
        schema: Any = {"type": "object"}
    else:
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object")
    try:
        return str(matcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS))
    except ValueError as e:
        raise InvalidRequestError(f"invalid JSON schema: {e}") from e
