"""KV streaming's engine side (engine/chunk_stream.py): after each step, a held prompt's owner hears
which blocks of its table a non-final chunk filled, in order, once each; the step that samples the
first token reports nothing (the held output carries the table); an aborted request stops reporting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.chunk_stream import PrefilledBlocks
from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
CHUNK = 8
PROMPT = list(range(3, 25))  # 22 tokens: chunks of 8, 8, 6 -> blocks 0-1, 2-3 reported, 4-5 held only
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model = tmp_path_factory.mktemp("tiny")
    (model / "config.json").write_text(json.dumps(TINY))
    return LLMEngine(EngineConfig(model=str(Path(model)), load_format="dummy", seed=3,
                                  cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=32),
                                  batcher=BatcherConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                        max_prefill_chunk=CHUNK)))


def test_each_non_final_chunk_reports_its_full_blocks_once_in_table_order(engine: LLMEngine) -> None:
    reports: list[PrefilledBlocks] = []
    engine.add_request("s1", PROMPT, GREEDY, hold_for_s=30.0, on_prefilled=reports.append)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    held = engine.held_blocks("s1")
    assert held is not None and steps == 3
    assert [(r.first_index, r.block_ids) for r in reports] == [(0, held.block_ids[0:2]), (2, held.block_ids[2:4])]
    assert not any(r.preempted for r in reports)
    engine.release_held("s1")


def test_an_aborted_request_reports_no_more(engine: LLMEngine) -> None:
    reports: list[PrefilledBlocks] = []
    other = [t + 50 for t in PROMPT]  # not in the prefix cache: prefilled in three chunks
    engine.add_request("s2", other, GREEDY, hold_for_s=30.0, on_prefilled=reports.append)
    engine.step()
    assert engine.abort("s2")
    engine.add_request("s3", PROMPT, GREEDY, hold_for_s=30.0)
    while engine.has_unfinished():
        engine.step()
    assert [r.first_index for r in reports] == [0]
    engine.release_held("s3")


def test_streaming_needs_a_held_request(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="hold_for_s"):
        engine.add_request("s4", PROMPT, GREEDY, on_prefilled=lambda _: None)


def test_a_preempted_request_reports_it_once_and_nothing_after(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", seed=3,
                                    cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=8, enable_prefix_caching=False),
                                    batcher=BatcherConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                          max_prefill_chunk=CHUNK)))
    engine.add_request("decoding", list(range(3, 10)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.step()
    reports: list[PrefilledBlocks] = []
    engine.add_request("s5", PROMPT, GREEDY, hold_for_s=30.0, on_prefilled=reports.append)
    while engine.has_unfinished():
        engine.step()  # the older decode's growth preempts s5 (newest) after its first chunk
    assert [(r.first_index, len(r.block_ids), r.preempted) for r in reports] == [(0, 2, False), (0, 0, True)]
    assert engine.held_blocks("s5") is not None  # recomputed and held; its owner stopped streaming
