"""Pipeline parallelism on CPU: stages over gloo must generate what one process generates.

- The split: which layers each stage holds, micro-batches of a step (no processes).
- A stage's model holds only its layers (plus the embedding first, norm and LM head last) and loads
  them from a whole checkpoint.
- The launcher: this process is rank 0 of a worker of PP=2 (and TP2 x PP2) and greedy generation
  through broadcast plans, micro-batched, gives the single-process runner's tokens.
- `baton generate --pipeline-parallel-size 2` gives PP=1's tokens on the default model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_tensor_parallel import BASE, greedy_generate, random_weights, write_dummy_model

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ScheduledChunk
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.errors import ConfigError
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM, MissingLayer
from engine.parallel.group import TensorParallel
from engine.parallel.launcher import TensorParallelRunner, create_model_runner
from engine.parallel.pipeline import PipelineParallel, split_microbatches, stage_layers
from engine.sampling_params import SamplingParams

# Three layers over two stages: an uneven split.
CONFIG = ModelConfig(**{**BASE, "num_layers": 3})


# ----------------------------------------------------------------------------- the split, no processes


def test_layers_split_evenly_and_the_first_stages_take_the_remainder() -> None:
    assert [stage_layers(3, 2, s) for s in range(2)] == [range(0, 2), range(2, 3)]
    assert [stage_layers(30, 4, s) for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [stage_layers(4, 1, 0)] == [range(0, 4)]


def test_more_stages_than_layers_is_rejected_naming_the_valid_sizes() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size \(4\) exceeds the model's layers \(3\); "
                                          r"valid sizes: 1..3"):
        stage_layers(3, 4, 0)


def test_pipeline_with_expert_parallelism_is_rejected() -> None:
    with pytest.raises(ConfigError, match="pipeline and expert parallelism together are not supported"):
        ParallelConfig(pipeline_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline_microbatches must be >= 1"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_microbatches=0)


def _chunk(rid: str, tokens: int) -> ScheduledChunk:
    return ScheduledChunk(rid, tuple(range(tokens)), 0, (0,), True, SamplingParams(), (), [])


def test_microbatches_are_contiguous_balanced_by_tokens_and_never_empty() -> None:
    chunks = [_chunk("a", 1), _chunk("b", 1), _chunk("c", 100)]
    assert [[c.request_id for c in g] for g in split_microbatches(chunks, 2)] == [["a", "b"], ["c"]]
    decodes = [_chunk(str(i), 1) for i in range(8)]
    assert [len(g) for g in split_microbatches(decodes, 4)] == [2, 2, 2, 2]
    assert [len(g) for g in split_microbatches(decodes[:3], 5)] == [1, 1, 1]  # never more groups than chunks
    assert [len(g) for g in split_microbatches(decodes[:3], 1)] == [3]


def test_a_stage_holds_only_its_layers_and_loads_them_from_the_whole_checkpoint() -> None:
    weights = random_weights(CONFIG)
    stages = []
    for rank in range(2):
        tp = TensorParallel(pipeline=PipelineParallel(rank=rank, size=2))
        model = LlamaForCausalLM(CONFIG, TorchAttentionBackend(), tp)
        model.load_weights(weights.items())
        stages.append(model)
    first, last = stages
    assert isinstance(first.model.layers[2], MissingLayer) and isinstance(last.model.layers[0], MissingLayer)
    assert first.model.norm is None and first.lm_head is None and last.model.embed_tokens is None
    assert torch.equal(last.model.layers[2].mlp.down_proj.weight, weights["model.layers.2.mlp.down_proj.weight"])
    assert torch.equal(first.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert last.model.layers[2].self_attn.layer == 0  # its KV cache holds one layer


# ------------------------------------------------------------------------------- launcher: greedy generation


def _runner_tokens(tmp_path: Path, parallel: ParallelConfig | None, config: ModelConfig = CONFIG) -> list[list[int]]:
    base = EngineConfig(model=str(write_dummy_model(tmp_path, config)), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=32))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    if parallel is None:
        return greedy_generate(ModelRunner(base, loaded.model_config, loaded.weights), 12)
    runner = create_model_runner(dataclasses.replace(base, parallel=parallel), loaded.model_config, loaded.weights)
    assert isinstance(runner, TensorParallelRunner)
    try:
        assert runner.num_blocks == 32
        assert runner.kv_spec.num_layers == 2  # stage 0 holds layers 0 and 1 of 3
        return greedy_generate(runner, 12)
    finally:
        runner.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("microbatches", [1, 3])
def test_pp2_runner_generates_the_single_process_tokens(tmp_path: Path, microbatches: int) -> None:
    """3 micro-batches of the 3-sequence decodes: every activation and logits message is split."""
    expected = _runner_tokens(tmp_path, None)
    got = _runner_tokens(tmp_path, ParallelConfig(pipeline_parallel_size=2, pipeline_microbatches=microbatches,
                                                  timeout_s=60))
    assert got == expected


@pytest.mark.timeout(180)
def test_tp2_by_pp2_runner_generates_the_single_process_tokens(tmp_path: Path) -> None:
    """4 ranks: stage 0 = ranks 0, 1 and stage 1 = ranks 2, 3, each stage all-reducing in its own group."""
    expected = _runner_tokens(tmp_path, None)
    got = _runner_tokens(tmp_path, ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, timeout_s=90))
    assert got == expected


# --------------------------------------------------------------------------- baton generate, default model


def _generate(capsys: pytest.CaptureFixture[str], *flags: str) -> list[int]:
    from services.cli import main

    rc = main(["generate", "--prompt", "The capital of France is", "--temperature", "0", "--max-tokens", "12",
               "--json", *flags])
    assert rc == 0
    return list(json.loads(capsys.readouterr().out)["token_ids"])


@pytest.mark.timeout(240)
def test_baton_generate_pp2_gives_the_pp1_tokens_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    expected = _generate(capsys)
    assert len(expected) == 12
    assert _generate(capsys, "--pipeline-parallel-size", "2") == expected  # batches in flight (the default)
    assert _generate(capsys, "--pipeline-parallel-size", "2", "--no-pipeline-overlap") == expected
