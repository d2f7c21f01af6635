"""`baton generate --quantization fp8 --kv-cache-dtype fp8_e4m3` (services/common/quantization_flags.py's
flags, shared with `baton worker` and `baton serve`) runs FP8 weights over an FP8 cache."""

from __future__ import annotations

import json

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader.tiny import TINY_MODEL_NAME
from engine.sampling_params import SamplingParams
from services.cli import main


def test_baton_generate_runs_fp8_weights_over_an_fp8_cache(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", TINY_MODEL_NAME, "--prompt", "Hello there", "--temperature", "0",
               "--max-tokens", "6", "--json", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    result = json.loads(capsys.readouterr().out)
    # The CLI's engine: the tiny model under the default cache (~/.cache/baton), as `baton generate` finds it.
    engine = LLMEngine(EngineConfig(model=TINY_MODEL_NAME, quantization="fp8",
                                    cache=CacheConfig(kv_cache_dtype="fp8_e4m3")))
    assert engine.runner.kv_cache.dtype.itemsize == 1
    assert engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype.itemsize == 1
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode("Hello there")
    expected = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    assert rc == 0 and result["token_ids"] == expected[0]
