"""A worker with `--expert-parallel-size 2` (2 gloo ranks on CPU) serves a tiny Qwen3-MoE: the same greedy
tokens as one rank, the per-expert load metrics, and the roles it refuses. `ExpertLoadMeter` alone:
what it exports per interval."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from handoff_harness import transfer_config
from prometheus_client import CollectorRegistry

from engine.config import BatcherConfig, CacheConfig, EngineConfig, ParallelConfig
from engine.layers.moe import expert_load_imbalance
from engine.llm_engine import LLMEngine
from rpcgen.baton.v1 import worker_pb2 as pb
from rpcgen.baton.v1 import worker_pb2_grpc
from services.worker.config import WorkerConfig, WorkerRole
from services.worker.expert_load import ExpertLoadMeter
from services.worker.main import add_worker_args, build_engine_config, build_worker_config
from services.worker.server import WorkerServer

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [40, 41, 3])
NEW_TOKENS = 6


def engine_config(model_dir: Path, ep: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=64),
                        batcher=BatcherConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=8),
                        parallel=ParallelConfig(expert_parallel_size=ep, timeout_s=60))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe")
    (path / "config.json").write_text(json.dumps(QWEN3_MOE))
    return path


async def _serve(engine: LLMEngine) -> WorkerServer:
    config = WorkerConfig(role=WorkerRole.BOTH, model_id="moe", worker_id="w", transfer=transfer_config(),
                          drain_grace_s=0.0, expert_parallel_size=engine.config.parallel.expert_parallel_size)
    server = WorkerServer(config, engine)
    await server.start()
    return server


async def _generate(server: WorkerServer) -> list[list[int]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        outputs = []
        for i, prompt in enumerate(PROMPTS):
            request = pb.GenerateRequest(request_id=f"g{i}", prompt_token_ids=prompt,
                                         sampling=pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
            outputs.append([t for r in [r async for r in stub.Generate(request, timeout=60)] for t in r.token_ids])
        return outputs


@pytest.fixture
async def single_rank_tokens(moe_dir: Path) -> list[list[int]]:
    server = await _serve(LLMEngine(engine_config(moe_dir, 1)))
    try:
        return await _generate(server)
    finally:
        await server.drain()


@pytest.fixture
async def ep_worker(moe_dir: Path) -> AsyncIterator[WorkerServer]:
    engine = LLMEngine(engine_config(moe_dir, 2))
    server = await _serve(engine)
    yield server
    await server.drain()


@pytest.mark.timeout(180)
async def test_ep2_worker_serves_the_single_rank_tokens_and_exports_expert_load(
        ep_worker: WorkerServer, single_rank_tokens: list[list[int]]) -> None:
    assert await _generate(ep_worker) == single_rank_tokens
    assert all(len(t) == NEW_TOKENS for t in single_rank_tokens)
    registry = ep_worker.metrics.registry
    exported = [registry.get_sample_value("baton_moe_expert_tokens_total", {"expert": str(e)}) or 0.0
                for e in range(8)]
    routed = ep_worker.engine.runner.expert_load()
    assert routed is not None and routed.shape == (2, 8)
    # The first step is exported at once, later ones at most once a second: never more than was routed.
    assert 0 < sum(exported) <= int(routed.sum())
    assert (registry.get_sample_value("baton_moe_expert_imbalance") or 0.0) >= 1.0


@pytest.mark.timeout(180)
async def test_ep2_worker_refuses_a_prefill_or_decode_role(ep_worker: WorkerServer) -> None:
    assert not await ep_worker.role_switcher.apply("prefill")
    assert not await ep_worker.role_switcher.apply("decode")
    assert (await ep_worker.status()).role == "both"


def test_worker_flag_reaches_the_engine_and_needs_role_both() -> None:
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    args = parser.parse_args(["--role", "both", "--expert-parallel-size", "2"])
    assert build_engine_config(args).parallel.expert_parallel_size == 2
    assert build_worker_config(args).expert_parallel_size == 2
    with pytest.raises(ValueError, match="--expert-parallel-size needs --role both"):
        build_worker_config(parser.parse_args(["--role", "prefill", "--expert-parallel-size", "2"]))


def test_meter_exports_per_interval_deltas_summed_over_layers() -> None:
    loads = iter([torch.tensor([[3, 1], [2, 2]]), torch.tensor([[5, 1], [4, 2]]), torch.tensor([[9, 1], [4, 2]])])
    now = [0.0]
    registry = CollectorRegistry()
    meter = ExpertLoadMeter(lambda: next(loads), registry, interval_s=1.0, clock=lambda: now[0])

    def exported() -> list[float | None]:
        return [registry.get_sample_value("baton_moe_expert_tokens_total", {"expert": e}) for e in ("0", "1")]

    meter.maybe_observe()
    assert exported() == [5.0, 3.0]
    assert registry.get_sample_value("baton_moe_expert_imbalance") == 1.5  # layer 0: 3 / mean 2
    now[0] = 0.5
    meter.maybe_observe()  # within the interval: nothing read
    assert exported() == [5.0, 3.0]
    now[0] = 1.0
    meter.maybe_observe()  # delta [[2, 0], [2, 0]]
    assert exported() == [9.0, 3.0]
    assert registry.get_sample_value("baton_moe_expert_imbalance") == 2.0
    now[0] = 2.0
    meter.maybe_observe()  # delta: layer 0 only
    assert exported() == [13.0, 3.0]


def test_imbalance_skips_layers_that_routed_nothing() -> None:
    assert expert_load_imbalance(torch.tensor([[0, 0], [1, 3]])) == 1.5
    assert expert_load_imbalance(torch.zeros(2, 4, dtype=torch.int64)) == 1.0
