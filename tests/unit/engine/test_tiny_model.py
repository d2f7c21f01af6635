"""`baton-tiny-random`: the small second model (engine/loader/tiny.py) prepared from the default one."""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader.resolve import resolve_model
from engine.loader.tiny import TINY_CONFIG, TINY_MODEL_NAME, tiny_model_dir
from engine.sampling_params import SamplingParams


def test_the_tiny_model_is_a_config_plus_the_default_tokenizer(default_model_dir: Path) -> None:
    cache = default_model_dir.parents[1]
    path = tiny_model_dir(cache)
    assert path.name == TINY_MODEL_NAME and json.loads((path / "config.json").read_text()) == TINY_CONFIG
    assert (path / "tokenizer.json").read_bytes() == (default_model_dir / "tokenizer.json").read_bytes()
    assert not list(path.glob("*.safetensors"))  # random weights: nothing to download or store
    assert resolve_model(TINY_MODEL_NAME, cache_dir=cache) == (path, "dummy")
    assert tiny_model_dir(cache) == path  # prepared once


def test_the_tiny_model_serves_by_name_with_seeded_random_weights(default_model_dir: Path) -> None:
    cache = str(default_model_dir.parents[1])
    outputs = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(model=TINY_MODEL_NAME, cache_dir=cache))
        assert engine.model_config.hidden_size == 64 and engine.tokenizer is not None
        prompt = engine.tokenizer.encode("Hello there", add_special_tokens=False)
        outputs.append(engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert len(outputs[0][0]) == 8 and outputs[0] == outputs[1]  # same seed, same weights, same answer
