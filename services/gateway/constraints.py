"""`response_format` -> the grammar constraint the worker's sampler enforces (structured outputs).

`json_object` allows any JSON object; `json_schema` allows exactly the documents the schema accepts
(always enforced, whatever `strict` says: a constraint that may be broken is no constraint). The
schema is checked here with llguidance (the same engine the workers run), so a schema it cannot
compile is a 400 naming `response_format` before any worker is asked.
"""

from __future__ import annotations

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
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except ValueError as e:
        error = str(e)
    if error and not error.startswith("WARNING"):
        raise BadRequestError(f"response_format.json_schema.schema cannot be enforced: {error}", "response_format")
    return wpb.GUIDED_KIND_JSON_SCHEMA, json.dumps(schema)


def guided_for_tools(grammar: str) -> Guided:
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error and not error.startswith("WARNING"):
        raise BadRequestError(f"the tools' parameter schemas cannot be enforced: {error}", "tools")
    return wpb.GUIDED_KIND_LARK, grammar
