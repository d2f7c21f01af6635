"""The whole engine on tiny MoE checkpoints (Qwen3-MoE, Mixtral, DeepSeek-V2/V3 with latent attention)
against `transformers` on the same weights, CPU, float32.

Greedy decoding must be token-identical, one request at a time, under continuous batching with
small prefill chunks, and with n-gram speculative decoding (multi-token verify steps through the MoE and,
for DeepSeek, the expanded latent attention); `baton generate --model DIR` must give the same tokens.
Grammar-constrained outputs validate against their schema. (Per-position logits
agree within 1e-3 of the logit scale: tests/unit/engine/test_model_parity.py.) The checkpoints are
written at test time with the default model's tokenizer (tests/support/tiny_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.structured import GrammarKind, GuidedDecoding
from tests.support.prefix_hits import generate_counting_cached
from tests.support.required import require_module
from tests.support.tiny_moe import save_tiny_moe

# Qwen2-MoE (shared expert): logits in test_model_parity.py
FAMILIES = ["qwen3-moe", "mixtral", "deepseek-v2"]  # DeepSeek-V3: logits in test_model_parity.py
NEW_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "hi", "Write a haiku about the sea, then explain it briefly."]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            default_model_dir: Path) -> Path:
    return save_tiny_moe(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)


@pytest.fixture(scope="module")
def prompts(default_model_dir: Path) -> list[list[int]]:
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(moe_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    transformers = require_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    return [_greedy(model, p, NEW_TOKENS) for p in prompts]


@torch.inference_mode()
def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_one_at_a_time_matches_hf(moe_dir: Path, prompts: list[list[int]], hf_greedy: list[list[int]]) -> None:
    engine = LLMEngine(EngineConfig(model=str(moe_dir), cache=CacheConfig(num_blocks=128)))
    assert engine.model_config.moe is not None
    assert [engine.generate([p], GREEDY)[0] for p in prompts] == hf_greedy


def test_batched_small_prefill_chunks_match_hf(moe_dir: Path, prompts: list[list[int]],
                                               hf_greedy: list[list[int]]) -> None:
    engine = LLMEngine(EngineConfig(model=str(moe_dir), cache=CacheConfig(num_blocks=128),
                                    batcher=BatcherConfig(max_prefill_chunk=7, max_num_batched_tokens=16,
                                                          max_num_seqs=4)))
    assert engine.generate(prompts, GREEDY) == hf_greedy


def test_speculative_decoding_keeps_hf_tokens(moe_dir: Path, prompts: list[list[int]],
                                             hf_greedy: list[list[int]]) -> None:
    """The random models repeat themselves, so n-gram drafts are proposed and mostly accepted."""
    engine = LLMEngine(EngineConfig(model=str(moe_dir), cache=CacheConfig(num_blocks=128)))
    speculative = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, num_draft_tokens=4)
    assert [engine.generate([p], speculative)[0] for p in prompts] == hf_greedy
    assert engine.spec_stats.verify_chunks > 0 and engine.spec_stats.accepted_tokens > 0


COLOUR = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}}, "required": ["colour", "ok"],
          "additionalProperties": False}


def test_structured_output_validates_against_its_schema(moe_dir: Path, prompts: list[list[int]]) -> None:
    """Constrained and free rows in one batch: the schema's rows parse, the free row stays free."""
    engine = LLMEngine(EngineConfig(model=str(moe_dir), cache=CacheConfig(num_blocks=128)))
    assert engine.tokenizer is not None
    guided = GuidedDecoding(GrammarKind.JSON_SCHEMA, json.dumps(COLOUR))
    params = [SamplingParams(max_tokens=32, temperature=t, seed=3, guided=guided) for t in (0.0, 0.8)]
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, (prompt, p) in enumerate(zip(prompts[:2] + prompts[:1], [*params, free], strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    tokens_of: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens_of[out.request_id].extend(out.new_token_ids)
    outputs = [tokens_of[f"r{i}"] for i in range(3)]
    for tokens in outputs[:2]:
        jsonschema.validate(json.loads(engine.tokenizer.decode(tokens, skip_special_tokens=True)), COLOUR)
    assert not engine.tokenizer.decode(outputs[2], skip_special_tokens=True).lstrip().startswith("{")


# Only the latent (MLA) family: prefix caching of GQA MoE models is the dense model's test's layout.
@pytest.mark.parametrize("moe_dir", ["deepseek-v2"], indirect=True)
def test_prefix_cache_hit_on_the_latent_cache_matches_hf(moe_dir: Path, default_model_dir: Path) -> None:
    """A second prompt sharing a long system prompt reuses the first one's cached blocks (latents and rope
    keys) and still decodes HF's tokens."""
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    system = "You are a meticulous assistant. " * 6
    first, second = (tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
                     for q in ("Name a fruit.", "Name a city."))
    engine = LLMEngine(EngineConfig(model=str(moe_dir), cache=CacheConfig(num_blocks=128)))
    engine.generate([first], GREEDY)
    tokens, cached = generate_counting_cached(engine, "prefix-hit", second, GREEDY)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert cached == shared // 16 * 16 > 0
    transformers = require_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert tokens == _greedy(model, second, NEW_TOKENS)


@pytest.mark.parametrize("parallel", [("--expert-parallel-size", "1"), ("--expert-parallel-size", "2"),
                                      ("--tensor-parallel-size", "2")], ids=["single", "ep2", "tp2"])
def test_baton_generate_serves_the_moe_checkpoint(moe_dir: Path, hf_greedy: list[list[int]], parallel: tuple[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """EP 2: two gloo ranks, each loading half the experts from the checkpoint; TP 2: each holding half the
    heads (for DeepSeek: of q/kv_b/o, the latent replicated) and half of every expert's features."""
    from services.cli import main

    rc = main(["generate", "--model", str(moe_dir), "--chat", QUESTIONS[0], "--temperature", "0",
               "--max-tokens", str(NEW_TOKENS), "--json", *parallel])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["token_ids"] == hf_greedy[0][:len(result["token_ids"])]
    assert result["finish_reason"] == "stop" or len(result["token_ids"]) == NEW_TOKENS
