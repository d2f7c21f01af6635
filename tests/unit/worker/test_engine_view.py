"""The engine's read-only view for the worker (engine/engine_view.py): the KV pool's numbers as the
block manager has them, the KV export a transfer registers, and no expert load on a dense model."""

from __future__ import annotations

from pathlib import Path

from handoff_harness import BLOCK_SIZE, NUM_BLOCKS, build_engine

from engine.sampling_params import SamplingParams


def test_the_pool_numbers_follow_the_block_manager_as_a_request_takes_blocks(tiny_model_dir: Path) -> None:
    engine = build_engine(tiny_model_dir)
    try:
        before = engine.view.kv_pool()
        assert (before.block_size, before.total_blocks, before.free_blocks) == (BLOCK_SIZE, NUM_BLOCKS, NUM_BLOCKS)
        engine.add_request("r", list(range(3, 3 + 3 * BLOCK_SIZE)), SamplingParams(max_tokens=4, temperature=0.0))
        engine.step()  # the first chunk allocates the prompt's blocks
        during = engine.view.kv_pool()
        assert during.free_blocks < NUM_BLOCKS and during.total_blocks == NUM_BLOCKS
        assert during.free_blocks == engine.block_manager.num_free_blocks
    finally:
        engine.shutdown()


def test_one_rank_exports_its_whole_kv_cache_and_no_followers(tiny_model_dir: Path) -> None:
    engine = build_engine(tiny_model_dir)
    try:
        kv = engine.view.kv_export()
        assert kv.kv_cache is engine.runner.kv_cache and kv.kv_spec == engine.runner.kv_spec
        assert (kv.tp_size, kv.call_followers) == (1, None)
        assert engine.view.expert_load() is None  # a dense model: the worker exports no expert load
        assert engine.view.device.type == "cpu" and not engine.view.cuda_graphs
    finally:
        engine.shutdown()
