"""The whole engine on the default model (SmolLM2-135M-Instruct) against Hugging Face `transformers`.

Greedy decoding must be token-identical to transformers on the same weights, whatever the batching:
one request at a time, continuous batching with arrivals mid-flight, small forced prefill chunks and
prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.prefix_hits import generate_counting_cached
from tests.support.required import require_module

NEW_TOKENS = 32  # long enough for every batching case to overlap; 64 doubled the test time
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours of the rainbow.",
    "hi",
    "Translate 'good morning' into German, Spanish and Italian, one per line, with no other text.",
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    transformers = require_module("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (its own KV cache, EOS ignored)."""
    return [_hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(n):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens


def _engine(model_dir, **batcher) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=512),
                                  batcher=BatcherConfig(**batcher)))


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return _engine(default_model_dir)


def test_one_at_a_time_matches_hf(engine, prompts, hf_greedy):
    for prompt, expected in zip(prompts, hf_greedy, strict=True):
        assert engine.generate([prompt], GREEDY)[0] == expected


def test_continuous_batching_with_mid_flight_arrivals_matches_hf(engine, prompts, hf_greedy):
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 5 == 0:  # a new arrival every 5 steps, while others decode
            i, prompt = pending.pop(0)
            engine.add_request(f"cb-{i}", prompt, GREEDY)
            got[f"cb-{i}"] = []
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        step += 1
    assert [got[f"cb-{i}"] for i in range(len(prompts))] == hf_greedy


def test_small_prefill_chunks_match_hf(default_model_dir, prompts, hf_greedy):
    engine = _engine(default_model_dir, max_prefill_chunk=7, max_num_batched_tokens=16, max_num_seqs=4)
    assert engine.generate(prompts, GREEDY) == hf_greedy


def test_prefix_cache_hit_reuses_blocks_and_matches_hf(engine, hf_model):
    from tokenization.tokenizer import Tokenizer

    tok = engine.tokenizer
    assert isinstance(tok, Tokenizer)
    system = "You are a meticulous assistant. " * 12
    first = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}])
    second = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a city."}])
    engine.generate([first], GREEDY)
    tokens, cached = generate_counting_cached(engine, "prefix-hit", second, GREEDY)
    shared = len(_common_prefix(first, second))
    block = engine.config.cache.block_size
    assert cached == shared // block * block > 0
    assert tokens == _hf_greedy(hf_model, second, NEW_TOKENS)


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
