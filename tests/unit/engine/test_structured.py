"""Grammar-constrained sampling on the default model (CPU): every output parses and validates.

One engine for the module; the schemas cover objects, nesting, arrays, enums, numbers with bounds,
booleans, optional fields and `anyOf`. Greedy and sampled rows run in the same batch as an
unconstrained row, which must stay unconstrained.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured import GrammarKind, GuidedDecoding, apply_token_bitmask

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["colour", "ok"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "minItems": 1,
                                                "maxItems": 3}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 15}, "lat": {"type": "number", "minimum": -90, "maximum": 90}},
        "required": ["name", "lat"], "additionalProperties": False}}, "required": ["city"],
     "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
                "additionalProperties": False},
               {"type": "object", "properties": {"error": {"type": "string", "maxLength": 10}},
                "required": ["error"], "additionalProperties": False}]},
]
PROMPTS = ["Describe a person as JSON.", "Pick a colour.", "Give me some numbers.", "Where is Paris?",
           "Did it work?"]


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir)))


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    assert tok is not None
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[str]:
    assert engine.tokenizer is not None
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [engine.tokenizer.decode(outputs[f"r{i}"], skip_special_tokens=True) for i in range(len(prompts))]


def test_every_output_validates_against_its_schema(engine: LLMEngine) -> None:
    prompts = [_prompt(engine, t) for t in PROMPTS]
    params = [SamplingParams(max_tokens=96, temperature=0.0 if i % 2 else 0.8, seed=i,
                             guided=GuidedDecoding(GrammarKind.JSON_SCHEMA, json.dumps(s)))
              for i, s in enumerate(SCHEMAS)]
    unconstrained = SamplingParams(max_tokens=8, temperature=0.0)
    texts = _run(engine, [*prompts, prompts[0]], [*params, unconstrained])
    for schema, text in zip(SCHEMAS, texts, strict=False):
        jsonschema.validate(json.loads(text), schema)
    assert not texts[-1].lstrip().startswith("{")  # the free row in the same batch was not masked


def test_json_object_mode_yields_an_object(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=96, temperature=0.0, guided=GuidedDecoding(GrammarKind.JSON_OBJECT))
    (text,) = _run(engine, [_prompt(engine, "List two fruits.")], [params])
    assert isinstance(json.loads(text), dict)


def test_a_bad_schema_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError, match="json_schema"):
        GuidedDecoding(GrammarKind.JSON_SCHEMA, json.dumps({"type": "no-such-type"}))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        GuidedDecoding(GrammarKind.JSON_SCHEMA, "{")


def test_bitmask_disallows_unset_bits_and_the_vocab_tail() -> None:
    logits = torch.zeros(2, 40)
    mask = torch.tensor([[0b101, 0], [-1, 0]], dtype=torch.int32)  # row 0: tokens 0 and 2; row 1: 0..31
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == list(range(32))
    assert torch.equal(logits, torch.zeros(2, 40))  # the input is left alone
