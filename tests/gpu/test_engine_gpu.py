"""The CUDA engine end to end on a GPU: HF parity, greedy identity, CUDA graphs, tensor parallelism.

- A Llama-3.1-8B-shaped stack cut to 2 layers (hidden 4096, 32 heads, 8 KV heads, vocab 128256,
  llama3 RoPE) against `transformers` on the same weights: fp32 within 1e-3, bf16 within 2e-2, as
  ||ours - ref|| / ||ref|| per sequence, the reference always HF in fp32 (bf16-representable weights).
- A small fp32 model: greedy tokens identical to HF `generate`, through the runner with CUDA graphs.
- CUDA graph decode == eager decode (tokens in fp32; logits within 1e-2 in bf16 at the 8B shape), and
  padded rows leave every other KV slot untouched.
- Tensor parallel 2 (skipped with < 2 GPUs, NCCL, NVLink multicast off): logits == TP=1 within 1e-4
  (fp32), and greedy tokens of a `TensorParallelRunner` with CUDA graphs == TP=1's.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
transformers = require_module("transformers")
require_module("triton")

import torch.multiprocessing as mp  # noqa: E402

from engine.batch import BatchPlan, ScheduledChunk  # noqa: E402
from engine.config import BatcherConfig, CacheConfig, EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from engine.loader.dummy import dummy_weights  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.parallel.group import init_tensor_parallel, open_rendezvous, shutdown_tensor_parallel  # noqa: E402
from engine.parallel.launcher import TensorParallelRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the launcher forces it too; spawned ranks inherit it
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
LLAMA31_8B_2L = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                     rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192))
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
             tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
SMALL_CONFIG = ModelConfig.from_hf_config({**SMALL, "num_hidden_layers": 3, "architectures": ["LlamaForCausalLM"]})


# ------------------------------------------------------------------------------------------------ helpers


def make_hf(kwargs: dict, seed: int, std: float) -> torch.nn.Module:
    """HF Llama in fp32 on the GPU, weights N(0, std) rounded to bf16 values, norms in [0.5, 1.5)."""
    config = transformers.LlamaConfig(**kwargs)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, device="cuda") + 0.5)
            else:
                p.normal_(0.0, std, generator=gen)
            p.copy_(p.bfloat16().float())  # both sides then see exactly the same values in bf16
    return model.eval()


def engine_config(dtype: str, eager: bool, num_blocks: int = 512, max_num_seqs: int = 16, **kw) -> EngineConfig:
    return EngineConfig(model="unused", dtype=dtype, device="cuda", attention_backend="triton",
                        enforce_eager=eager, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                        batcher=BatcherConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096), **kw)


def runner_from_hf(hf: torch.nn.Module, dtype: str, eager: bool, **kw) -> ModelRunner:
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    return ModelRunner(engine_config(dtype, eager, **kw), config, hf.state_dict().items())


class Sequences:
    """Prompts with fixed, shuffled (non-contiguous) block tables, turned into plan chunks."""

    def __init__(self, prompts: list[list[int]], max_len: int, seed: int = 0) -> None:
        per_seq = math.ceil(max_len / BLOCK)
        ids = torch.randperm(per_seq * len(prompts) + 8, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tokens = {str(i): list(p) for i, p in enumerate(prompts)}
        self.blocks = {rid: tuple(ids[i * per_seq:(i + 1) * per_seq]) for i, rid in enumerate(self.tokens)}
        self.outputs: dict[str, list[int]] = {rid: [] for rid in self.tokens}

    def prefill(self) -> list[ScheduledChunk]:
        return [self.chunk(rid, 0) for rid in self.tokens]

    def decode(self) -> list[ScheduledChunk]:
        return [self.chunk(rid, len(t) - 1) for rid, t in self.tokens.items()]

    def chunk(self, rid: str, start: int) -> ScheduledChunk:
        toks = self.tokens[rid]
        return ScheduledChunk(rid, tuple(toks[start:]), start, self.blocks[rid], True, GREEDY, toks, self.outputs[rid])

    def extend(self, sampled: dict) -> None:
        for rid, s in sampled.items():
            self.tokens[rid].append(s.token_id)
            self.outputs[rid].append(s.token_id)


def greedy(runner: ModelRunner | TensorParallelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    seqs = Sequences(prompts, max(map(len, prompts)) + new_tokens)
    seqs.extend(runner.execute(BatchPlan(tuple(seqs.prefill()))).sampled)
    for _ in range(new_tokens - 1):
        seqs.extend(runner.execute(BatchPlan(tuple(seqs.decode()))).sampled)
    return [seqs.outputs[rid] for rid in sorted(seqs.outputs, key=int)]


@torch.inference_mode()
def eager_logits(runner: ModelRunner, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """Logits of every token row of an eager step (the runner itself samples only the last rows)."""
    inputs = runner.prepare_inputs(chunks)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
    return runner.model.compute_logits(hidden)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert not ours.isnan().any(), "NaN in our logits"
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


# ------------------------------------------------------------------------------- 8B-shaped vs transformers


@pytest.fixture(scope="module")
def hf_8b_2l() -> torch.nn.Module:
    return make_hf(LLAMA31_8B_2L, seed=0, std=0.02)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 2e-2)])
def test_8b_shaped_prefill_and_decode_match_transformers(hf_8b_2l: torch.nn.Module, dtype: str,
                                                         tolerance: float) -> None:
    prompts = random_prompts([300, 57], 128256, seed=1)
    runner = runner_from_hf(hf_8b_2l, dtype, eager=True)
    seqs = Sequences(prompts, 400)
    got = {rid: [] for rid in seqs.tokens}
    prefill = eager_logits(runner, seqs.prefill())
    got["0"].append(prefill[:300])
    got["1"].append(prefill[300:])
    for step in range(6):  # decode with the prompts' own continuation tokens appended (teacher forcing)
        for rid in seqs.tokens:
            seqs.tokens[rid].append((17 * step + int(rid)) % 128256)
        logits = eager_logits(runner, seqs.decode())
        for i, rid in enumerate(seqs.tokens):
            got[rid].append(logits[i:i + 1])
    with torch.inference_mode():
        for rid, toks in seqs.tokens.items():
            ref = hf_8b_2l(torch.tensor([toks], device="cuda")).logits[0].float()
            err = rel_err(torch.cat(got[rid]), ref)
            assert err <= tolerance, f"sequence {rid} ({dtype}): relative error {err:.2e}"


# -------------------------------------------------------------------------- greedy identity, small, fp32


@pytest.fixture(scope="module")
def hf_small() -> torch.nn.Module:
    return make_hf(SMALL, seed=2, std=0.08)


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain argmax over HF's own KV cache (not `generate`, whose logits processors may mask EOS)."""
    out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]], device="cuda"), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def test_greedy_tokens_match_transformers_with_cuda_graphs(hf_small: torch.nn.Module) -> None:
    prompts = random_prompts([40, 7, 123], 1024, seed=3)
    runner = runner_from_hf(hf_small, "float32", eager=False)
    assert runner.graphs is not None and runner.graphs.max_batch == 16
    got = greedy(runner, prompts, 24)
    assert got == [hf_greedy(hf_small, p, 24) for p in prompts]


# ------------------------------------------------------------------------------- CUDA graphs vs eager


def test_cuda_graph_decode_tokens_equal_eager_decode(hf_small: torch.nn.Module) -> None:
    prompts = random_prompts([33, 5, 64, 17, 90], 1024, seed=4)  # 5 sequences: padded to 8 in the graph
    graph_tokens = greedy(runner_from_hf(hf_small, "float32", eager=False), prompts, 20)
    eager_tokens = greedy(runner_from_hf(hf_small, "float32", eager=True), prompts, 20)
    assert graph_tokens == eager_tokens


def test_cuda_graph_logits_match_eager_and_padding_writes_nothing(hf_8b_2l: torch.nn.Module) -> None:
    runner = runner_from_hf(hf_8b_2l, "bfloat16", eager=False, num_blocks=256)
    seqs = Sequences(random_prompts([70, 3, 150, 31, 9], 128256, seed=5), 200)
    assert runner.graphs is not None and runner.graphs.padded_size(5) == 8
    runner.execute(BatchPlan(tuple(seqs.prefill())))
    for rid in seqs.tokens:
        seqs.tokens[rid].append(11)
    chunks = seqs.decode()
    eager = eager_logits(runner, chunks)  # writes the decode tokens' K/V
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        graph = runner.graphs.run(chunks).clone()  # rewrites the same 5 slots, nothing else
    err = rel_err(graph, eager)
    assert graph.shape == eager.shape and err <= 1e-2, f"graph vs eager logits: {err:.2e}"
    written = torch.zeros(runner.kv_cache.shape[0], BLOCK, dtype=torch.bool, device="cuda")
    for c in chunks:
        written[c.block_ids[c.start_pos // BLOCK], c.start_pos % BLOCK] = True
    untouched = ~written[:, None, None, :]  # [blocks, 1, 1, block_size] against [blocks, L, 2, bs, H, D]
    assert torch.equal(runner.kv_cache.masked_select(untouched[..., None, None]),
                       before.masked_select(untouched[..., None, None]))


# ------------------------------------------------------------------------------------ tensor parallel

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")


def tp_steps(runner: ModelRunner) -> torch.Tensor:
    """Prefill of two prompts then 4 eager decodes; every row's logits (fp32)."""
    seqs = Sequences(random_prompts([45, 12], 1024, seed=6), 80)
    out = [eager_logits(runner, seqs.prefill())]
    for t in range(4):
        for rid in seqs.tokens:
            seqs.tokens[rid].append(100 + t)
        out.append(eager_logits(runner, seqs.decode()))
    return torch.cat(out)


def _tp_logits_worker(rank: int, port: int, out_dir: str) -> None:
    config = engine_config("float32", eager=True, parallel=ParallelConfig(tensor_parallel_size=2, timeout_s=120))
    tp = init_tensor_parallel(config.parallel, rank, port, "cuda")
    try:
        runner = ModelRunner(config, SMALL_CONFIG, dummy_weights(SMALL_CONFIG, torch.float32, tp.device, seed=9), tp)
        logits = tp_steps(runner)
        if tp.is_driver:
            torch.save(logits.cpu(), os.path.join(out_dir, "tp_logits.pt"))
    finally:
        shutdown_tensor_parallel()


@needs_2_gpus
def test_tp2_logits_match_tp1(tmp_path: Path) -> None:
    rendezvous = open_rendezvous(ParallelConfig(tensor_parallel_size=2))
    mp.start_processes(_tp_logits_worker, args=(rendezvous.port, str(tmp_path)), nprocs=2, start_method="spawn")
    got = torch.load(tmp_path / "tp_logits.pt")
    single = ModelRunner(engine_config("float32", eager=True), SMALL_CONFIG,
                         dummy_weights(SMALL_CONFIG, torch.float32, "cuda", seed=9))
    expected = tp_steps(single).cpu()
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() / expected.abs().max().item() <= 1e-4


def write_dummy_dir(path: Path) -> Path:
    import json

    (path / "config.json").write_text(json.dumps({**SMALL, "architectures": ["LlamaForCausalLM"]}))
    return path


@needs_2_gpus
def test_tp2_runner_generates_tp1_tokens(tmp_path: Path) -> None:
    from engine.loader import load_model

    base = dataclasses.replace(engine_config("float32", eager=False), model=str(write_dummy_dir(tmp_path)),
                               load_format="dummy", seed=4)
    prompts = random_prompts([40, 7, 123], 1024, seed=7)
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    expected = greedy(ModelRunner(base, loaded.model_config, loaded.weights), prompts, 16)
    tp_config = dataclasses.replace(base, parallel=ParallelConfig(tensor_parallel_size=2, timeout_s=120))
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    runner = TensorParallelRunner(tp_config, loaded.model_config, loaded.weights)
    try:
        assert runner.runner.graphs is not None  # TP decode replays captured graphs (NCCL inside)
        got = greedy(runner, prompts, 16)
    finally:
        runner.shutdown()
    assert got == expected
