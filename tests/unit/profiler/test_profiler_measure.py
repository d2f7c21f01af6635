"""Step timing on a real (tiny, dummy-weight) model runner: block accounting and re-measuring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig
from engine.loader import load_model
from engine.model_runner import ModelRunner
from scheduler.calibration.points import DecodePoint, Measurements, PrefillPoint
from services.profiler.grid import ProfileGrid
from services.profiler.measure import StepTimer, TimingConfig, fill_kv_with_noise, measure_grid, remeasure

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
NUM_BLOCKS = 16  # 256 slots of 16 tokens


@pytest.fixture(scope="module")
def timer_and_blocks(tmp_path_factory: pytest.TempPathFactory) -> tuple[StepTimer, BlockManager]:
    model_dir = tmp_path_factory.mktemp("tiny")
    Path(model_dir, "config.json").write_text(json.dumps(TINY))
    config = EngineConfig(model=str(model_dir), load_format="dummy", cache=CacheConfig(num_blocks=NUM_BLOCKS))
    loaded = load_model(config.model, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    fill_kv_with_noise(runner, seed=0)
    blocks = BlockManager(NUM_BLOCKS, block_size=16)
    return StepTimer(runner, blocks, 128, runner.device), blocks


def test_prefill_over_a_cached_prefix_is_timed_and_gives_its_blocks_back(timer_and_blocks):
    timer, blocks = timer_and_blocks
    samples = timer.time(PrefillPoint(new_tokens=40, cached_tokens=64), runs=2)
    assert samples is not None and len(samples) == 2 and min(samples) > 0
    assert blocks.num_free_blocks == NUM_BLOCKS


def test_a_decode_batch_is_timed_and_gives_its_blocks_back(timer_and_blocks):
    timer, blocks = timer_and_blocks
    samples = timer.time(DecodePoint(batch=3, context_per_seq=70), runs=1)
    assert samples is not None and samples[0] > 0
    assert blocks.num_free_blocks == NUM_BLOCKS


def test_a_point_larger_than_the_pool_is_skipped_and_leaks_nothing(timer_and_blocks):
    timer, blocks = timer_and_blocks
    assert timer.time(DecodePoint(batch=3, context_per_seq=100), runs=1) is None  # 3 x 7 blocks > 16
    assert timer.time(PrefillPoint(new_tokens=300), runs=1) is None
    assert blocks.num_free_blocks == NUM_BLOCKS


def test_the_grid_is_timed_in_rounds_and_too_large_points_are_listed_as_skipped(timer_and_blocks):
    timer, _ = timer_and_blocks
    grid = ProfileGrid(prefill=(PrefillPoint(16), PrefillPoint(300)), decode=(DecodePoint(2, 32),))
    rounds: list[str] = []
    measured = measure_grid(timer, grid, TimingConfig(warmup=1, repeats=3), rounds.append)
    assert [p for p, _ in measured.prefill] == [PrefillPoint(16)]
    assert [d for d, _ in measured.decode] == [DecodePoint(2, 32)]
    assert measured.skipped == (PrefillPoint(300),)
    assert len(rounds) == 3


def test_remeasuring_keeps_the_faster_time_of_each_point(timer_and_blocks):
    timer, _ = timer_and_blocks
    slow, fast = PrefillPoint(16), DecodePoint(1, 16)
    measured = Measurements(prefill=((slow, 100.0),), decode=((fast, 1e-9),))
    again = remeasure(timer, measured, [slow, fast], repeats=1)
    assert again.prefill[0][1] < 100.0  # a real step is far faster than 100 s
    assert again.decode[0][1] == 1e-9  # nothing real is faster than 1 ns


def test_timing_needs_at_least_one_round():
    with pytest.raises(ValueError, match="repeats >= 1"):
        TimingConfig(repeats=0)
