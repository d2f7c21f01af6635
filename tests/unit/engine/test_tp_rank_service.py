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

from engine.block_manager import BlockManager
from engine.config import CacheConfig, EngineConfig, ParallelConfig
from engine.engine_view import EngineView
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.parallel.launcher import FollowerCallError, TensorParallelRunner, create_model_runner


@dataclasses.dataclass(frozen=True)
class ShardShape:
    """Reply: (rank, the shape of its KV shard)."""


@dataclasses.dataclass(frozen=True)
class Fail:
    """Raise on the follower."""


class ShardProbe:
    """A follower's companion: reads its own KV shard, or fails on demand."""

    def __init__(self, runner: ModelRunner, rank: int) -> None:
        self.runner, self.rank = runner, rank

    def handle(self, request: object) -> object:
        if isinstance(request, ShardShape):
            return self.rank, tuple(self.runner.kv_cache.shape)
        if isinstance(request, Fail):
            raise RuntimeError("probe failed on purpose")
        raise TypeError(f"not served: {request!r}")

    def close(self) -> None:
        pass


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
    replies: list[list[object]] = []
    stop = threading.Event()

    def keep_calling() -> None:
        while not stop.is_set():
            replies.append(runner.call_followers(ShardShape()))

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
def test_the_engine_view_exports_rank_0s_shard_and_reaches_the_followers(tp_setup) -> None:
    runner, _ = tp_setup
    view = EngineView(runner, BlockManager(runner.num_blocks, 4, True))
    kv = view.kv_export()
    assert kv.kv_cache is runner.kv_cache and kv.tp_size == TP
    assert kv.call_followers is not None and kv.call_followers(ShardShape()) == [(1, tuple(runner.kv_cache.shape))]


@pytest.mark.timeout(120)
def test_a_follower_exception_is_raised_on_rank_0_and_the_group_goes_on(tp_setup) -> None:
    runner, expected = tp_setup
    with pytest.raises(FollowerCallError, match="Fail failed on 1 follower.*RuntimeError: probe failed on purpose"):
        runner.call_followers(Fail())
    with pytest.raises(FollowerCallError, match="rank 1: TypeError: not served"):
        runner.call_followers("shard_shape")  # a request the service does not know: an error, the group goes on
    assert runner.call_followers(ShardShape()) == [(1, tuple(runner.kv_cache.shape))]
    assert greedy_generate(runner, 10) == expected
