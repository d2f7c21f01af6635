"""The whole engine on tiny MoE checkpoints (Qwen3-MoE, Mixtral) against `transformers` on the same
weights, CPU, float32.

Greedy decoding must be token-identical, one request at a time and under continuous batching with
small prefill chunks; `baton generate --model DIR` must give the same tokens. (Per-position logits
agree within 1e-3 of the logit scale: tests/unit/engine/test_model_parity.py.) The checkpoints are
written at test time with the default model's tokenizer (tests/support/tiny_moe.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.required import require_module
from tests.support.tiny_moe import save_tiny_moe

FAMILIES = ["qwen3-moe", "mixtral"]  # Qwen2-MoE (shared expert): logits in test_model_parity.py
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


@pytest.mark.parametrize("expert_parallel_size", ["1", "2"])
def test_baton_generate_serves_the_moe_checkpoint(moe_dir: Path, hf_greedy: list[list[int]], expert_parallel_size: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """With 2: two gloo ranks, each loading half the experts from the checkpoint."""
    from services.cli import main

    rc = main(["generate", "--model", str(moe_dir), "--chat", QUESTIONS[0], "--temperature", "0",
               "--max-tokens", str(NEW_TOKENS), "--json", "--expert-parallel-size", expert_parallel_size])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["token_ids"] == hf_greedy[0][:len(result["token_ids"])]
    assert result["finish_reason"] == "stop" or len(result["token_ids"]) == NEW_TOKENS
