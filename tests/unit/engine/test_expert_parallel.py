"""Expert parallelism on CPU: 2 gloo ranks, each holding half the experts, must compute what one does.

- Without processes: a rank loads only its experts; the token and expert splits; the refused
  configurations (EP with TP, a dense model, experts that do not divide).
- `ep_results`: 2 spawned ranks run tiny random Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert, one
  dense layer) models through prefill, a mixed step and decodes (logits within 1e-4 of the logit scale
  of EP=1), then greedy-decode 3 prompts, the last steps one sequence alone (a rank with no tokens):
  the tokens must equal EP=1's. They also run the fused Triton
  MoE kernel (under triton's CPU interpreter) as the local-expert compute of the all-to-all.
- FP8 experts (online quantization): each of the 2 ranks holds only its half of the experts, in e4m3, and
  the ranks give the logits and tokens of one process holding them all in FP8.
- The launcher: this process is rank 0 of an EP=2 worker group (one spawned follower) and greedy
  generation through broadcast plans gives the single-process runner's tokens and per-expert counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from paged_harness import PagedHarness
from test_tensor_parallel import build_model, greedy_generate, random_weights, run_steps

from engine.attention.torch_ref import TorchAttentionBackend
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.errors import ConfigError
from engine.layers.moe import SparseMoeBlock
from engine.layers.moe_ops import expert_outputs_reference
from engine.loader.dummy import dummy_weights
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.moe_config import MIXTRAL_EXPERT_NAMES, MoeConfig
from engine.parallel.expert import ExpertParallel, dispatch_compute_combine
from engine.parallel.group import TensorParallel, init_tensor_parallel, open_rendezvous, shutdown_tensor_parallel
from engine.parallel.launcher import TensorParallelRunner, create_model_runner
from engine.quant.config import Fp8Config
from engine.quant.fp8 import FP8_DTYPE, quantize_rows

EP = 2
TOLERANCE = 1e-4  # of max |logit|
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=128)
CASES = {
    "qwen3-moe": ModelConfig(**BASE, architecture="Qwen3MoeForCausalLM", moe=MoeConfig(
        num_experts=8, top_k=2, intermediate_size=32, renormalize=True, sparse_layers=(0, 1))),
    "mixtral": ModelConfig(**BASE, architecture="MixtralForCausalLM", moe=MoeConfig(
        num_experts=4, top_k=2, intermediate_size=48, renormalize=True, sparse_layers=(0, 1),
        names=MIXTRAL_EXPERT_NAMES)),
    "qwen2-moe-shared-expert": ModelConfig(**BASE, architecture="Qwen2MoeForCausalLM", moe=MoeConfig(
        num_experts=6, top_k=3, intermediate_size=32, renormalize=False, sparse_layers=(1,),
        shared_expert_intermediate_size=48, shared_expert_gated=True)),
}
PROMPTS = ([5, 17, 3, 88, 42, 7, 19, 60, 2], [33, 1, 90, 45, 12], [70])
NEW_TOKENS = 8


# ------------------------------------------------------------------------------------- no processes


def test_a_rank_loads_only_its_experts() -> None:
    config = CASES["qwen3-moe"]
    weights = dict(dummy_weights(config, torch.float32, seed=7))
    block = SparseMoeBlock(config, TensorParallel(expert=ExpertParallel(rank=1, size=2)))
    prefix = "model.layers.0.mlp."
    for name in block.hf_names():
        block.load(name, weights[prefix + name])
    assert block.experts.owned == range(4, 8) and block.experts.w13.shape == (4, 64, 64)
    for local, expert in enumerate(range(4, 8)):
        gate, up = (weights[f"{prefix}experts.{expert}.{p}.weight"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(block.experts.w13.data[local], torch.cat([gate, up]))
        assert torch.equal(block.experts.w2.data[local], weights[f"{prefix}experts.{expert}.down_proj.weight"])


def test_a_rank_holds_only_its_experts_fp8_bytes() -> None:
    config = CASES["qwen3-moe"]
    weights = dict(dummy_weights(config, torch.float32, seed=7))
    block = SparseMoeBlock(config, TensorParallel(expert=ExpertParallel(rank=1, size=2)))
    block.use_fp8(Fp8Config())
    prefix = "model.layers.0.mlp."
    for name in block.hf_names():
        block.load(name, weights[prefix + name])
    experts = block.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w13.nbytes + experts.w2.nbytes == 4 * 3 * 32 * 64  # 4 of 8
    for local, expert in enumerate(range(4, 8)):
        q, s = quantize_rows(weights[f"{prefix}experts.{expert}.down_proj.weight"])
        assert torch.equal(experts.w2[local].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(experts.w2_scale[local], s)


def test_each_moe_layer_counts_k_slots_per_token_until_reset() -> None:
    config = CASES["qwen2-moe-shared-expert"]  # layer 0 dense, layer 1 sparse with top-3
    model = build_model(config, TensorParallel())
    run_steps(model, config, 1)
    load = model.expert_load()
    assert load is not None and load.shape == (1, 6)
    assert int(load.sum()) == 3 * (6 + 5 + 3 + 1 + 3 + 3 * 3)  # k slots of every token of run_steps
    model.reset_expert_load()
    assert int(model.expert_load().sum()) == 0


def test_token_slices_cover_every_token_once() -> None:
    for tokens in (0, 1, 3, 7, 8):
        slices = [ExpertParallel(rank=r, size=3).token_slice(tokens) for r in range(3)]
        assert [i for start, end in slices for i in range(start, end)] == list(range(tokens))


def test_unsupported_expert_parallel_configurations_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor and expert parallelism together are not supported"):
        ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ConfigError, match="expert_parallel_size must be >= 1"):
        ParallelConfig(expert_parallel_size=0)
    dense = ModelConfig(**BASE, architecture="LlamaForCausalLM")
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model; this one is dense"):
        LlamaForCausalLM(dense, TorchAttentionBackend(), TensorParallel(expert=ExpertParallel(size=2)))
    with pytest.raises(ConfigError, match=r"num_experts \(6\) is not divisible by expert_parallel_size \(4\)"):
        LlamaForCausalLM(CASES["qwen2-moe-shared-expert"], TorchAttentionBackend(),
                         TensorParallel(expert=ExpertParallel(rank=0, size=4)))


# ------------------------------------------------------------------------------ 2 ranks: logits, tokens


def greedy_tokens(model: LlamaForCausalLM, config: ModelConfig) -> list[list[int]]:
    harness = PagedHarness(model, config, block_size=4, num_blocks=64)
    logits = harness.step([(str(i), p) for i, p in enumerate(PROMPTS)])
    out: dict[str, list[int]] = {rid: [int(row[-1].argmax())] for rid, row in logits.items()}
    while len(out["2"]) < NEW_TOKENS:
        # The last two steps decode one sequence alone: one token, so rank 1 has none to send.
        running = out if len(out["0"]) < NEW_TOKENS - 2 else {"2": out["2"]}
        logits = harness.step([(rid, toks[-1:]) for rid, toks in running.items()])
        for rid, row in logits.items():
            out[rid].append(int(row[-1].argmax()))
    return [out[str(i)] for i in range(len(PROMPTS))]


def fused_dispatch(ep: ExpertParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all with the fused kernel (interpreted) as the local compute, and with the reference."""
    from tests.support.triton_interpret import import_interpreted, interpreted

    (fused_moe,) = import_interpreted("engine.kernels.fused_moe")
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(6, 2 * 24, 40, generator=gen) * 0.2, torch.randn(6, 40, 24, generator=gen) * 0.2
    x, ids = torch.randn(9, 40, generator=gen), torch.randint(0, 6, (9, 2), generator=gen)
    start, end = ep.token_slice(9)
    local = ep.expert_range(6)
    w13, w2 = w13[local.start:local.stop], w2[local.start:local.stop]
    with interpreted():
        fused = dispatch_compute_combine(ep, x[start:end], ids[start:end], 6,
                                         lambda rows, e: fused_moe.fused_expert_outputs(rows, e, w13, w2))
    ref = dispatch_compute_combine(ep, x[start:end], ids[start:end], 6,
                                   lambda rows, e: expert_outputs_reference(rows, e, w13, w2))
    return fused, ref


def build_fp8_model(config: ModelConfig, tp: TensorParallel) -> LlamaForCausalLM:
    """`build_model` with every projection and expert quantized to FP8 as it loads (`--quantization fp8`)."""
    model = LlamaForCausalLM(config, TorchAttentionBackend(), tp)
    model.use_fp8(Fp8Config())
    model.load_weights(random_weights(config).items())
    return model.eval()


def _ep_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(ParallelConfig(expert_parallel_size=EP, timeout_s=60), rank, port, "cpu")
    try:
        assert tp.size == 1 and tp.expert.rank == rank and tp.world_rank == rank
        results: dict[str, object] = {}
        for name, cfg in CASES.items():
            model = build_model(cfg, tp)
            results[name] = (run_steps(model, cfg, 1), greedy_tokens(model, cfg))
        fp8 = build_fp8_model(CASES["qwen3-moe"], tp)
        experts = fp8.model.layers[0].mlp.experts
        results["fp8"] = (run_steps(fp8, CASES["qwen3-moe"], 1), greedy_tokens(fp8, CASES["qwen3-moe"]),
                          str(experts.w13.dtype), (experts.owned.start, experts.owned.stop))
        results["fused"] = fused_dispatch(tp.expert)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        shutdown_tensor_parallel()


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("ep")
    rendezvous = open_rendezvous(ParallelConfig(expert_parallel_size=EP))
    mp.start_processes(_ep_worker, args=(rendezvous.port, str(out)), nprocs=EP, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(EP)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_ep2_gives_the_single_process_logits_and_greedy_tokens(ep_results: list[dict], case: str) -> None:
    config = CASES[case]
    model = build_model(config, TensorParallel())
    expected_logits, expected_tokens = run_steps(model, config, 1), greedy_tokens(model, config)
    assert len({tuple(t) for t in expected_tokens}) > 1  # the prompts lead to different continuations
    for rank in range(EP):  # attention is replicated: every rank computes the logits
        logits, tokens = ep_results[rank][case]
        assert logits.shape == expected_logits.shape
        assert (logits - expected_logits).abs().max().item() / expected_logits.abs().max().item() <= TOLERANCE
        assert tokens == expected_tokens


@pytest.mark.timeout(180)
def test_ep2_over_fp8_experts_gives_the_single_process_fp8_logits_and_tokens(ep_results: list[dict]) -> None:
    config = CASES["qwen3-moe"]
    model = build_fp8_model(config, TensorParallel())
    expected_logits, expected_tokens = run_steps(model, config, 1), greedy_tokens(model, config)
    for rank in range(EP):
        logits, tokens, dtype, owned = ep_results[rank]["fp8"]
        assert dtype == str(FP8_DTYPE) and owned == (4 * rank, 4 * rank + 4)  # its half of the experts, in e4m3
        assert (logits - expected_logits).abs().max().item() / expected_logits.abs().max().item() <= TOLERANCE
        assert tokens == expected_tokens


@pytest.mark.timeout(180)
def test_the_fused_kernel_computes_the_dispatched_rows(ep_results: list[dict]) -> None:
    for rank in range(EP):
        fused, ref = ep_results[rank]["fused"]
        assert fused.shape == ref.shape and fused.shape[1:] == (2, 40) and fused.shape[0] in (4, 5)
        torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- launcher: greedy generation


def write_dummy_moe_model(path: Path) -> Path:
    """Qwen3-MoE as a config.json (dummy weights)."""
    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              norm_topk_prob=True)
    (path / "config.json").write_text(json.dumps(hf))
    return path


@pytest.mark.timeout(120)
def test_ep2_runner_generates_the_single_process_tokens(tmp_path: Path) -> None:

    from engine.loader import load_model

    base = EngineConfig(model=str(write_dummy_moe_model(tmp_path)), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=32))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    single = ModelRunner(base, loaded.model_config, loaded.weights)
    expected = greedy_generate(single, 10)

    ep_config = dataclasses.replace(base, parallel=ParallelConfig(expert_parallel_size=EP, timeout_s=60))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    runner = create_model_runner(ep_config, loaded.model_config, loaded.weights)
    assert isinstance(runner, TensorParallelRunner)
    try:
        assert runner.tp.world_size == EP and runner.runner.model.model.layers[0].mlp.experts.w13.shape[0] == 4
        got = greedy_generate(runner, 10)
        load = runner.expert_load()
    finally:
        runner.shutdown()
    assert got == expected
    assert load is not None and torch.equal(load, single.expert_load())
    assert load.shape == (2, 8) and int(load.sum()) > 0
