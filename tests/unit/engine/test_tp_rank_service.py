"""Rank services of a TensorParallelRunner: `call_followers` from a second thread of rank 0 (as the
worker's KV link thread does) interleaves safely with `execute` on the engine thread, and a
follower's exception comes back to rank 0 without breaking the group."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
from test_tensor_parallel import CASES, TP, greedy_generate, write_dummy_model

from engine.config import CacheConfig, EngineConfig, ParallelConfig
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.parallel.launcher import FollowerCallError, TensorParallelRunner, create_model_runner


class ShardProbe:
    """A follower's companion: reads its own KV shard, or fails on demand."""

    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner, self.rank = runner, rank

    def shard_shape(self) -> tuple[int, tuple[int, ...]]:
        return self.rank, tuple(self.runner.kv_cache.shape)

    def fail(self) -> None:
        raise RuntimeError("probe failed on purpose")


@dataclasses.dataclass(frozen=True)
class ShardProbeFactory:
    def __call__(self, runner: ModelRunner, tp: Any) -> ShardProbe:
        return ShardProbe(runner, tp.rank)


@pytest.fixture
def tp_setup(tmp_path: Path):  # noqa: ANN201
    config = CASES["kv-heads-equal-tp"]
    base = EngineConfig(model=str(write_dummy_model(tmp_path, config)), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=32))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    expected = greedy_generate(ModelRunner(base, loaded.model_config, loaded.weights), 10)
    tp_config = dataclasses.replace(base, parallel=ParallelConfig(tensor_parallel_size=TP, timeout_s=60))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    runner = create_model_runner(tp_config, loaded.model_config, loaded.weights, ShardProbeFactory())
    assert isinstance(runner, TensorParallelRunner)
    try:
        yield runner, expected
    finally:
        runner.shutdown()


@pytest.mark.timeout(120)
def test_follower_calls_from_another_thread_interleave_with_steps(tp_setup) -> None:
    runner, expected = tp_setup
    replies: list[list[Any]] = []
    stop = threading.Event()

    def keep_calling() -> None:
        while not stop.is_set():
            replies.append(runner.call_followers("shard_shape"))

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        got = greedy_generate(runner, 10)
    finally:
        stop.set()
        caller.join(30)
    assert got == expected
    assert replies and all(r == [(1, tuple(runner.kv_cache.shape))] for r in replies)


@pytest.mark.timeout(120)
def test_a_follower_exception_is_raised_on_rank_0_and_the_group_goes_on(tp_setup) -> None:
    runner, expected = tp_setup
    with pytest.raises(FollowerCallError, match="rank 1: RuntimeError: probe failed on purpose"):
        runner.call_followers("fail")
    assert runner.call_followers("shard_shape") == [(1, tuple(runner.kv_cache.shape))]
    assert greedy_generate(runner, 10) == expected
