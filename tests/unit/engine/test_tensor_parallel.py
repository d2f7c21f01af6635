"""Tensor parallelism on CPU: 2 gloo ranks must compute what one process computes.

- Sharded layers load the right slices of HF tensors (no processes: a rank's layers are built alone).
- `model_logits`: 2 spawned ranks run a tiny random Llama through prefill, a mixed varlen step and
  decodes over their own KV shards; rank 0's logits equal the TP=1 model's within 1e-4 of the
  logit scale. Cases: KV heads > tp, == tp, < tp (replicated), tied embeddings with a vocabulary
  that does not divide (padded shard), q/k/v and o_proj biases, MoE experts and a shared expert,
  DeepSeek's latent attention (heads sharded, the latent replicated) with and without q_lora, through
  the expanded (prefill, mixed) and absorbed (decode) paths.
- The launcher: this process is rank 0 of a `TensorParallelRunner` (one spawned follower) and greedy
  generation through broadcast plans gives the TP=1 runner's tokens.
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

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import BatchPlan, ScheduledChunk
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.errors import ConfigError
from engine.kv_cache import kv_cache_spec_for
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, OutputShard, RowParallelLinear
from engine.loader.dummy import dummy_weights
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.moe_config import MoeConfig
from engine.parallel.group import (
    TensorParallel,
    init_tensor_parallel,
    local_kv_heads,
    open_rendezvous,
    shutdown_tensor_parallel,
)
from engine.parallel.launcher import TensorParallelRunner, create_model_runner
from engine.sampling_params import SamplingParams

TP = 2
TOLERANCE = 1e-4  # of max |logit|
BASE = dict(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
CASES = {
    "kv-heads-equal-tp": ModelConfig(**BASE),
    "kv-heads-above-tp": ModelConfig(**{**BASE, "num_kv_heads": 4}),
    "kv-heads-below-tp-replicated": ModelConfig(**{**BASE, "num_kv_heads": 1}),
    "tied-odd-vocab": ModelConfig(**{**BASE, "vocab_size": 97, "tie_word_embeddings": True}),
    "qkv-and-o-bias": ModelConfig(**{**BASE, "attention_bias": True, "o_proj_bias": True}),
    # Experts sharded along their intermediate features, a gated shared expert, one dense layer.
    "moe-shared-expert": ModelConfig(**{**BASE, "architecture": "Qwen2MoeForCausalLM", "moe": MoeConfig(
        num_experts=4, top_k=2, intermediate_size=32, renormalize=False, sparse_layers=(1,),
        shared_expert_intermediate_size=48, shared_expert_gated=True)}),
}
# DeepSeek-V2 (MLA without q_lora, interleaved rope rows, a dense first layer, routed + shared experts) and V3.
DEEPSEEK_HF = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1)
CASES["mla-v2"] = ModelConfig.from_hf_config(DEEPSEEK_HF)
CASES["mla-v3-q-lora"] = ModelConfig.from_hf_config({**DEEPSEEK_HF, "architectures": ["DeepseekV3ForCausalLM"],
                                                     "q_lora_rank": 24, "n_group": 2, "topk_group": 1})
PROMPTS = ([5, 17, 3, 88, 42, 7, 19, 60, 2], [33, 1, 90, 45, 12], [70, 71, 72])


# ------------------------------------------------------------------------ shard loading, no processes


def test_column_parallel_loads_this_ranks_rows_and_replicates_shared_kv_heads() -> None:
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    rank1 = TensorParallel(rank=1, size=2)
    layer = ColumnParallelLinear(3, [OutputShard.even(8, rank1, "q"), OutputShard(8, 4, 4)], bias=False)
    layer.load_shard(0, "weight", full)
    layer.load_shard(1, "weight", full)
    assert torch.equal(layer.weight.data, torch.cat([full[4:], full[4:]]))


def test_row_parallel_loads_this_ranks_input_columns() -> None:
    full = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
    layer = RowParallelLinear(6, 4, bias=False, tp=TensorParallel(rank=1, size=2))
    layer.load("weight", full)
    assert torch.equal(layer.weight.data, full[:, 3:])


def test_vocab_shard_pads_the_last_rank_with_zero_rows() -> None:
    full = torch.randn(97, 4)
    last = VocabParallelEmbedding(97, 4, TensorParallel(rank=1, size=2))
    last.load("weight", full)
    assert last.vocab_start == 49 and last.num_valid == 48
    assert torch.equal(last.weight.data[:48], full[49:]) and not last.weight.data[48].any()


def test_unshardable_models_are_rejected_naming_the_valid_sizes() -> None:
    config = ModelConfig(**{**BASE, "num_heads": 12, "num_kv_heads": 6, "intermediate_size": 96})
    with pytest.raises(ConfigError, match=r"num_kv_heads \(6\).*valid sizes for this model: \[1, 2, 3, 6, 12\]"):
        LlamaForCausalLM(config, TorchAttentionBackend(), TensorParallel(rank=0, size=4))
    moe = dataclasses.replace(CASES["moe-shared-expert"].moe, intermediate_size=30)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(30\) is not divisible by tensor_parallel_size"):
        LlamaForCausalLM(dataclasses.replace(CASES["moe-shared-expert"], moe=moe), TorchAttentionBackend(),
                         TensorParallel(rank=0, size=4))


# ------------------------------------------------------------------------------- model logits, 2 ranks


def run_steps(model: LlamaForCausalLM, config: ModelConfig, tp_size: int) -> torch.Tensor:
    """Prefill, a mixed step (chunk + decode + new prefill), then decodes; all logits concatenated."""
    harness = PagedHarness(model, config, block_size=4, num_blocks=64)
    harness.spec = kv_cache_spec_for(config.num_layers, local_kv_heads(config.num_kv_heads, tp_size),
                                     config.head_dim, config.mla.latent_dim if config.mla else None, 4, "float32")
    harness.kv_cache = harness.spec.allocate(64, "cpu")
    a, b, c = PROMPTS
    steps = [[("a", a[:6]), ("b", b)], [("a", a[6:]), ("b", [4]), ("c", c)]]
    steps += [[("a", [t]), ("b", [t + 1]), ("c", [t + 2])] for t in (8, 30, 50)]
    return torch.cat([logits for step in steps for logits in harness.step(step).values()])


def random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dummy weights with random biases and norms: the dummy zeros and ones would hide a bias added
    on every rank, or a norm weight sliced by mistake."""
    gen = torch.Generator().manual_seed(11)
    weights = dict(dummy_weights(config, torch.float32, seed=7))
    for name, w in weights.items():
        if name.endswith(".bias"):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.1)
        elif name.endswith("norm.weight"):
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
    return weights


def build_model(config: ModelConfig, tp: TensorParallel) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, TorchAttentionBackend(), tp)
    model.load_weights(random_weights(config).items())
    return model.eval()


def _logits_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(ParallelConfig(tensor_parallel_size=TP, timeout_s=60), rank, port, "cpu")
    try:
        results = {name: run_steps(build_model(cfg, tp), cfg, TP) for name, cfg in CASES.items()}
        if tp.is_driver:
            torch.save(results, os.path.join(out_dir, "logits.pt"))
    finally:
        shutdown_tensor_parallel()


@pytest.fixture(scope="module")
def tp_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("tp")
    rendezvous = open_rendezvous(ParallelConfig(tensor_parallel_size=TP))
    mp.start_processes(_logits_worker, args=(rendezvous.port, str(out)), nprocs=TP, start_method="spawn")
    return torch.load(out / "logits.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_match_single_process(tp_logits: dict[str, torch.Tensor], case: str) -> None:
    config = CASES[case]
    expected = run_steps(build_model(config, TensorParallel()), config, 1)
    got = tp_logits[case]
    assert got.shape == expected.shape == (6 + 5 + 3 + 1 + 3 + 3 * 3, config.vocab_size)
    assert (got - expected).abs().max().item() / expected.abs().max().item() <= TOLERANCE


# ------------------------------------------------------------------------- launcher: greedy generation


def write_dummy_model(path: Path, config: ModelConfig) -> Path:
    hf = dict(architectures=[config.architecture], vocab_size=config.vocab_size, hidden_size=config.hidden_size,
              intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
              num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
              head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def greedy_generate(runner: ModelRunner | TensorParallelRunner, new_tokens: int) -> list[list[int]]:
    """Drive a runner the way the batcher would: a split prefill mixed with decodes, then decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    seqs = {str(i): list(p) for i, p in enumerate(PROMPTS)}
    blocks = {rid: tuple(range(8 * i + 3, 8 * i + 11)) for i, rid in enumerate(seqs)}  # 8 blocks of 4 each
    outputs: dict[str, list[int]] = {rid: [] for rid in seqs}

    def chunk(rid: str, start: int, end: int) -> ScheduledChunk:
        toks = seqs[rid]
        return ScheduledChunk(rid, tuple(toks[start:end]), start, blocks[rid], end == len(toks), params,
                              PROMPTS[int(rid)], outputs[rid])

    first = [chunk("0", 0, 4), chunk("1", 0, len(seqs["1"]))]
    second = [chunk("0", 4, len(seqs["0"])), chunk("2", 0, len(seqs["2"]))]
    plans = [first, second]
    while min(len(o) for o in outputs.values()) < new_tokens:
        plan = plans.pop(0) if plans else [chunk(rid, len(t) - 1, len(t)) for rid, t in seqs.items()]
        for rid, sampled in runner.execute(BatchPlan(tuple(plan))).sampled.items():
            outputs[rid].append(sampled.token_id)
            seqs[rid].append(sampled.token_id)
    return [outputs[rid][:new_tokens] for rid in sorted(outputs)]


@pytest.mark.timeout(120)
def test_tp2_runner_generates_the_single_process_tokens(tmp_path: Path) -> None:
    from engine.loader import load_model

    config = CASES["kv-heads-below-tp-replicated"]
    base = EngineConfig(model=str(write_dummy_model(tmp_path, config)), load_format="dummy", seed=3,
                        cache=CacheConfig(block_size=4, num_blocks=32))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    expected = greedy_generate(ModelRunner(base, loaded.model_config, loaded.weights), 12)

    tp_config = dataclasses.replace(base, parallel=ParallelConfig(tensor_parallel_size=TP, timeout_s=60))
    loaded = load_model(base.model, "dummy", "float32", "cpu", seed=base.seed)
    runner = create_model_runner(tp_config, loaded.model_config, loaded.weights)
    assert isinstance(runner, TensorParallelRunner)
    try:
        assert runner.kv_spec.num_kv_heads == 1 and runner.num_blocks == 32
        got = greedy_generate(runner, 12)
    finally:
        runner.shutdown()
    assert got == expected


_PARENT_SCRIPT = """
import os
import time
import torch.multiprocessing as mp
from engine.parallel import launcher

def follower(parent):  # what a follower does first, then it is stuck (in a collective, NIXL teardown...)
    launcher._exit_with_parent(parent, poll_s=0.1)
    time.sleep(600)

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=follower, args=(os.getpid(),), daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_stuck_follower_exits_when_rank0_is_killed(tmp_path: Path) -> None:
    """`daemon=True` covers only a rank 0 that exits normally; after a SIGKILL of rank 0 a follower
    that is not blocked on rank 0's sockets would keep its GPU memory forever."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "rank0.py"
    script.write_text(_PARENT_SCRIPT)
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[3],
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    try:
        assert rank0.stdout is not None
        follower = int(rank0.stdout.readline())
        assert _alive(follower)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        give_up = time.monotonic() + 10
        while _alive(follower) and time.monotonic() < give_up:
            time.sleep(0.1)
        assert not _alive(follower)
    finally:
        rank0.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()
