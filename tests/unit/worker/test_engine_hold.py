"""LLMEngine's prefill-side hold (blocks kept after the first token) and the decode-side commit, on one
engine: a manual hand-off by tensor copy gives the same tokens as a local request."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_integrity import block_checksums
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStats

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock() -> Clock:
    return Clock()


@pytest.fixture(scope="module")
def engine(default_model_dir, clock) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir), cache=CacheConfig(num_blocks=64)), clock=clock)


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "Name three rivers in Europe, please."}])


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_a_held_request_yields_one_token_and_keeps_its_blocks(engine, prompt):
    free = engine.block_manager.num_free_blocks
    engine.add_request("h1", prompt, GREEDY, hold_for_s=30.0)
    outs = _drain(engine)
    assert [(o.request_id, len(o.new_token_ids), o.finish_reason) for o in outs] == [("h1", 1, FinishReason.LENGTH)]
    held = engine.held_blocks("h1")
    assert held is not None and len(held.block_ids) == engine.block_manager.blocks_for(len(prompt) + 1)
    assert engine.block_manager.num_free_blocks == free - len(held.block_ids)
    assert not engine.abort("h1")  # abort never frees blocks a WRITE may be reading
    assert engine.release_held("h1") and not engine.release_held("h1")
    assert engine.block_manager.num_free_blocks == free


def test_an_expired_lease_releases_the_blocks(engine, prompt, clock):
    free = engine.block_manager.num_free_blocks
    engine.add_request("h2", prompt, GREEDY, hold_for_s=5.0)
    _drain(engine)
    assert engine.release_expired_holds() == []
    clock.now += 5.0
    assert engine.release_expired_holds() == ["h2"]
    assert engine.block_manager.num_free_blocks == free and engine.num_held_blocks == 0


def test_held_id_cannot_be_reused_until_released(engine, prompt):
    engine.add_request("h3", prompt, GREEDY, hold_for_s=30.0)
    _drain(engine)
    with pytest.raises(InvalidRequestError, match="still held"):
        engine.add_request("h3", prompt, GREEDY)
    with pytest.raises(InvalidRequestError, match="hold_for_s"):
        engine.add_request("h4", prompt, GREEDY, hold_for_s=0.0)
    engine.release_held("h3")


def test_manual_handoff_by_block_copy_matches_a_local_request(engine, prompt):
    local = engine.generate([prompt], GREEDY)[0]
    longer = prompt + engine.tokenizer.encode(" And three in Asia.")
    expected = engine.generate([longer], GREEDY)[0]
    engine.add_request("pre", longer, GREEDY, hold_for_s=30.0)
    first = _drain(engine)[0].new_token_ids[0]
    held = engine.held_blocks("pre")
    block_ids, cached = engine.reserve_remote("dec", longer, GREEDY)
    bs = engine.block_manager.block_size
    kv = engine.runner.kv_cache
    todo = range(cached // bs, -(-len(longer) // bs))  # skip blocks the prefix cache already holds
    kv[[block_ids[i] for i in todo]] = kv[[held.block_ids[i] for i in todo]]
    engine.release_held("pre")
    outs = engine.commit_remote("dec", first) + _drain(engine)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected and local != expected
    assert torch.isfinite(kv).all()


def test_step_stats_split_prefill_and_decode(engine, prompt):
    engine.add_request("s", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    prefill = engine.last_step
    engine.step()
    decode = engine.last_step
    assert isinstance(prefill, StepStats)
    assert prefill.prefill_tokens > 0 and prefill.decode_seqs == 0  # fewer than the prompt if cached
    assert decode is not None and (decode.decode_seqs, decode.prefill_tokens) == (1, 0)
    assert decode.decode_context_tokens == len(prompt) + 1
    _drain(engine)
    assert engine.step() == [] and engine.last_step is None


def test_held_checksums_per_head_slice_are_what_each_decode_rank_will_hold(engine, prompt):
    """Heterogeneous TP: for a decode worker of TP size 3, slice j of every block is its head j (3 KV heads)."""
    engine.add_request("s3", prompt, GREEDY, hold_for_s=30.0, checksum_hold=True, checksum_slices=3)
    _drain(engine)
    held = engine.held_blocks("s3")
    assert held is not None and held.checksums is not None
    ids, n = list(held.block_ids), len(held.block_ids)
    ranks = [block_checksums(engine.runner.kv_cache[:, :, :, :, j:j + 1].contiguous(), ids) for j in range(3)]
    assert list(held.checksums) == ranks[0] + ranks[1] + ranks[2] and len(held.checksums) == 3 * n
    assert engine.release_held("s3")
    with pytest.raises(InvalidRequestError, match="checksum_slices 2 does not divide the KV heads"):
        engine.add_request("s2", prompt, GREEDY, hold_for_s=30.0, checksum_hold=True, checksum_slices=2)
