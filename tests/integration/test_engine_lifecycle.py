"""Engine lifecycle on the default model: seeded sampling, block accounting, bad input."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


def _engine(model_dir, num_blocks: int = 512, **batcher) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=num_blocks),
                                  batcher=BatcherConfig(**batcher)))


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return _engine(default_model_dir)


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "Tell me a short story about a fox."}])


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (p, params) in requests.items():
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in got:
                got[out.request_id].extend(out.new_token_ids)
    return got


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine, prompt):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    alone = _run(engine, {"s": (prompt, seeded)})["s"]
    other = engine.tokenizer.encode("Once upon a time")
    crowd = _run(engine, {
        "noise-a": (other, SamplingParams(max_tokens=30, temperature=1.2)),
        "s": (prompt, seeded),
        "noise-b": (prompt[:-3], SamplingParams(max_tokens=10, temperature=0.8, seed=7)),
    })["s"]
    assert crowd == alone
    different = _run(engine, {"s2": (prompt, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99))})
    assert different["s2"] != alone


def test_block_pool_returns_to_initial_after_finish_abort_and_preemption(default_model_dir):
    # 20 blocks of 16 tokens cannot hold 8 sequences of ~90 tokens at once: preemption must happen.
    engine = _engine(default_model_dir, num_blocks=20, max_num_seqs=8, max_num_batched_tokens=256)
    initial = engine.block_manager.num_free_blocks
    rng = random.Random(0)
    base = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from one to fifty in words."}])
    for i in range(8):
        engine.add_request(f"r{i}", base + [rng.randrange(100, 1000)] * i, SamplingParams(
            max_tokens=rng.randint(50, 65), temperature=0.0, ignore_eos=True))
    finished, steps = set(), 0
    while engine.has_unfinished():
        finished |= {o.request_id for o in engine.step() if o.finished}
        steps += 1
        if steps in (15, 45):  # abort one running and one possibly preempted request
            assert engine.abort(f"r{steps % 8}")
    assert engine.batcher.num_preemptions > 0
    assert len(finished) == 6
    assert engine.block_manager.num_free_blocks == initial


def test_finish_reasons(engine, prompt):
    engine.add_request("len", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"len": FinishReason.LENGTH}


@pytest.mark.parametrize("bad", [
    lambda e, p: e.add_request("empty", [], SamplingParams()),
    lambda e, p: e.add_request("long", p * 2000, SamplingParams()),
    lambda e, p: e.add_request("vocab", [e.model_config.vocab_size + 5], SamplingParams()),
    lambda e, p: e.add_request("neg", [-1], SamplingParams()),
    lambda e, p: SamplingParams(temperature=-1.0),
    lambda e, p: SamplingParams(top_p=0.0),
    lambda e, p: SamplingParams(max_tokens=0),
    lambda e, p: SamplingParams(logprobs=1000),
])
def test_bad_input_is_a_typed_error_and_the_engine_keeps_working(engine, prompt, bad):
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError):
        bad(engine, prompt)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == free
    assert len(engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]) >= 1


def test_duplicate_request_id_is_refused(engine, prompt):
    engine.add_request("dup", prompt, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("dup", prompt, SamplingParams(max_tokens=2))
    engine.abort("dup")
    assert not engine.has_unfinished()


def test_unknown_model_path_is_a_load_error(tmp_path: Path):
    with pytest.raises(ModelLoadError):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))


def test_corrupt_gguf_is_a_load_error(tmp_path: Path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError):
        LLMEngine(EngineConfig(model=str(bad)))
