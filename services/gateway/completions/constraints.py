"""`response_format` -> the grammar constraint the worker's sampler enforces (structured outputs).

`json_object` allows any JSON object; `json_schema` allows exactly the documents the schema accepts
(always enforced, whatever `strict` says: a constraint that may be broken is no constraint). The
schema is checked here with llguidance (the same engine the workers run), so a schema it cannot
compile is a 400 naming `response_format` before any worker is asked. So is one that compiles but
admits no document at all (`{"$ref": "#"}` alone, `false`, `allOf` of a string and an integer): a
matcher over a byte vocabulary (model-independent, ~0.1 ms) finds no first byte for it. Without this
check the worker's first mask allows only end-of-sequence, and the answer is an empty 200.
(A schema whose every document is infinite, such as a required self-reference, still starts: the
answer stops at max_tokens with finish reason `length`.)
"""

from __future__ import annotations

import functools
import json

import llguidance

from rpcgen.baton.v1 import worker_pb2 as wpb
from services.gateway.errors import BadRequestError
from services.gateway.schemas import ResponseFormat

Guided = tuple[int, str]


def guided_for_format(fmt: ResponseFormat | None) -> Guided | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return wpb.GUIDED_KIND_JSON_OBJECT, ""
    assert fmt.json_schema is not None  # the schema model requires it for json_schema
    schema = fmt.json_schema.schema_
    try:
        error = _grammar_error(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except ValueError as e:
        error = str(e)
    if error:
        raise BadRequestError(f"response_format.json_schema.schema cannot be enforced: {error}", "response_format")
    return wpb.GUIDED_KIND_JSON_SCHEMA, json.dumps(schema)


def guided_for_tools(grammar: str) -> Guided:
    error = _grammar_error(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error:
        raise BadRequestError(f"the tools' parameter schemas cannot be enforced: {error}", "tools")
    return wpb.GUIDED_KIND_LARK, grammar


def _grammar_error(grammar: str) -> str:
    """Why the grammar cannot constrain an output ("" when it can): it does not compile, or no output
    can even begin."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        return str(error)
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    matcher.compute_bitmask()
    if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
        reason = matcher.get_error().partition("\n")[0] or "stopped"
        return f"it admits no output: no first character is possible (llguidance: {reason})"
    return ""


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer("byte")
