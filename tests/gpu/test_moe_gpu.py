"""The fused MoE kernel and the MoE families on a CUDA GPU.

- The compiled kernel (engine/kernels/fused_moe.py) against the torch reference expert loop on the
  same GPU, at Qwen3-30B-A3B's MoE shape (hidden 2048, 128 experts of 768, top-8): bf16 at 1, 64
  and 4096 tokens within 1e-2 as ||fused - ref|| / ||ref|| (both accumulate in fp32 and round the
  same intermediates; only reduction order differs), fp32 within 1e-4 elementwise.
- Every launch configuration the table or `bench_moe --sweep` can pick (engine/kernels/fused_moe_configs.py)
  at its rows class's token count, same bound; the one-program alignment equal to the torch one;
  the routing and combine kernels (engine/kernels/moe_route.py) and Qwen3's q/k head norm
  (engine/kernels/head_norm.py) against the torch code.
- Tiny Qwen3-MoE and Mixtral checkpoints (tests/support/tiny_moe.py) through the CUDA runner with
  CUDA graphs (the fused kernel captured): greedy tokens identical to `transformers` on the GPU, fp32.
- CUDA graph decode == eager decode on a dummy-weight Qwen3-MoE in bf16 (the alignment step must
  not sync with the host, or capture fails).
- Expert parallelism over 2 GPUs (NCCL all-to-all, the fused kernel on each rank's experts): greedy
  tokens and per-expert counts equal to one GPU's (with CUDA graphs) on a dummy-weight Qwen3-MoE, fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("transformers")
triton = require_module("triton")

from test_engine_gpu import engine_config, greedy, hf_greedy, random_prompts, rel_err  # noqa: E402

from engine.config import ModelConfig, ParallelConfig  # noqa: E402
from engine.kernels.fused_moe import _grouped_gemm_kernel, fused_expert_outputs  # noqa: E402
from engine.kernels.fused_moe_configs import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIGS,
    MoeKernelConfig,
    RowsPerExpert,
    sweep_candidates,
)
from engine.kernels.head_norm import rmsnorm_heads  # noqa: E402
from engine.kernels.kv_store import is_interpreted  # noqa: E402
from engine.kernels.moe_align import align_slots_to_experts_fused, align_slots_to_experts_torch  # noqa: E402
from engine.kernels.moe_route import combine_weighted, route_top_k  # noqa: E402
from engine.layers.moe_ops import (  # noqa: E402
    combine_expert_outputs_reference,
    expert_outputs_reference,
    route_tokens,
    route_tokens_reference,
)
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.loader.dummy import dummy_weights  # noqa: E402
from engine.loader.weights import load_model_weights  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.parallel.launcher import TensorParallelRunner  # noqa: E402
from tests.support.tiny_moe import build_tiny_moe  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
DEVICE = torch.device("cuda")
QWEN3_MOE_SMALL = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 256, "norm_topk_prob": True}
DEEPSEEK_V2_SMALL = {  # DeepSeek-V2-Lite's attention (16 heads, 512 + 64 latent), fewer and smaller experts
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 16, "n_shared_experts": 2, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
    "first_k_dense_replace": 1, "max_position_embeddings": 2048}


def test_kernel_is_compiled_not_interpreted() -> None:
    assert not is_interpreted(_grouped_gemm_kernel)


def moe_inputs(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen, device=DEVICE).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device=DEVICE) * 0.02).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device=DEVICE) * 0.02).to(dtype)
    router = torch.randn(tokens, EXPERTS, generator=gen, device=DEVICE)
    return x, route_tokens(router, TOP_K, renormalize=True).expert_ids, w13, w2


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_bf16_fused_moe_matches_the_reference_at_qwen3_30b_shape(tokens: int) -> None:
    x, ids, w13, w2 = moe_inputs(tokens, torch.bfloat16, seed=tokens)
    got = fused_expert_outputs(x, ids, w13, w2)
    expected = expert_outputs_reference(x, ids, w13, w2)
    assert got.shape == (tokens, TOP_K, HIDDEN)
    assert rel_err(got, expected) <= 1e-2


CLASS_TOKENS = {RowsPerExpert.DECODE_SMALL: 1, RowsPerExpert.DECODE: 64, RowsPerExpert.MIXED: 1024,
                RowsPerExpert.PREFILL: 4096}
CASES = list(dict.fromkeys([*((rows, c) for rows in RowsPerExpert for c in sweep_candidates(rows)),
                            *DEFAULT_CONFIGS.items(), *((rows, c) for (rows, _, _), c in CONFIGS.items())]))


def inputs_per_class(make: Callable[[int], tuple[torch.Tensor, ...]],
                     reference: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]) -> dict:
    """Per rows class: `make(its token count)` and the reference output of those inputs (computed once)."""
    cases = {}
    for rows, tokens in CLASS_TOKENS.items():
        inputs = make(tokens)
        cases[rows] = (inputs, reference(inputs))
    return cases


def run_config_or_skip(config: MoeKernelConfig, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`run()` under `config`: a sweep candidate that does not fit this card skips (an error row of the
    sweep, never its pick); a table entry must fit."""
    try:
        return run()
    except triton.runtime.errors.OutOfResources as e:
        if config in DEFAULT_CONFIGS.values() or config in CONFIGS.values():
            raise
        pytest.skip(f"{config} does not fit this GPU: {e}")


@pytest.fixture(scope="module")
def class_inputs() -> dict[RowsPerExpert, tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return inputs_per_class(lambda tokens: moe_inputs(tokens, torch.bfloat16, seed=tokens),
                            lambda inputs: expert_outputs_reference(*inputs))


@pytest.mark.parametrize(("rows", "config"), CASES, ids=lambda v: str(v.value if isinstance(v, RowsPerExpert) else v))
def test_every_config_matches_the_reference_at_its_rows_class(rows: RowsPerExpert, config: MoeKernelConfig,
                                                              class_inputs: dict) -> None:
    inputs, expected = class_inputs[rows]
    got = run_config_or_skip(config, lambda: fused_expert_outputs(*inputs, config))
    assert rel_err(got, expected) <= 1e-2


def test_one_token_layer_replays_in_a_cuda_graph_with_new_routing() -> None:
    x, ids, w13, w2 = moe_inputs(1, torch.bfloat16, seed=21)
    static_x, static_ids = x.clone(), ids.clone()
    fused_expert_outputs(static_x, static_ids, w13, w2)  # warm-up: compiles, makes the constant rows
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_expert_outputs(static_x, static_ids, w13, w2)
    for seed in (22, 23):
        x, ids, _, _ = moe_inputs(1, torch.bfloat16, seed=seed)
        static_x.copy_(x)
        static_ids.copy_(ids)
        graph.replay()
        assert rel_err(out, expert_outputs_reference(x, ids, w13, w2)) <= 1e-2


@pytest.mark.parametrize(("tokens", "block_m"), [(1, 16), (64, 16), (512, 32), (512, 64)])
def test_one_program_alignment_equals_the_torch_alignment(tokens: int, block_m: int) -> None:
    _, ids, _, _ = moe_inputs(tokens, torch.bfloat16, seed=tokens + 1)
    fused, torch_ = (align(ids, EXPERTS, block_m) for align in (align_slots_to_experts_fused,
                                                                align_slots_to_experts_torch))
    used = int(torch_.num_padded_rows.item())
    assert torch.equal(fused.num_padded_rows, torch_.num_padded_rows)
    assert torch.equal(fused.sorted_slots, torch_.sorted_slots)
    assert torch.equal(fused.block_experts[: used // block_m], torch_.block_experts[: used // block_m])


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_routing_and_combine_kernels_match_the_torch_code(tokens: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    logits = torch.randn(tokens, EXPERTS, generator=gen, device=DEVICE)  # fp32: no ties
    weights, ids = route_top_k(logits, TOP_K, renormalize=True)
    expected = route_tokens_reference(logits, TOP_K, renormalize=True)
    assert torch.equal(ids, expected.expert_ids)
    torch.testing.assert_close(weights, expected.weights, rtol=1e-5, atol=1e-6)
    outputs = torch.randn(tokens, TOP_K, HIDDEN, generator=gen, device=DEVICE).bfloat16()
    got = combine_weighted(outputs, weights)
    torch.testing.assert_close(got.float(), combine_expert_outputs_reference(outputs, weights).float(),
                               rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("tokens", [1, 300])
def test_qk_head_norm_kernel_matches_the_torch_norm_in_place_on_qkv(tokens: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    qkv = torch.randn(tokens, (32 + 2 * 4) * 128, generator=gen, device=DEVICE).bfloat16()  # Qwen3-30B-A3B
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    norm = RMSNorm(128, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128, generator=gen, device=DEVICE) + 0.5)
    norm = norm.bfloat16()
    got, expected = rmsnorm_heads(q, norm.weight, norm.eps), norm._norm(q)
    # the same roundings; the float32 mean may differ in its last bit, so a bf16 step at most
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)
    assert (got != expected).float().mean().item() < 0.01


def test_fp32_fused_moe_matches_the_reference() -> None:
    x, ids, w13, w2 = moe_inputs(200, torch.float32, seed=5)
    torch.testing.assert_close(fused_expert_outputs(x, ids, w13, w2), expert_outputs_reference(x, ids, w13, w2),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "deepseek-v2", "deepseek-v3"])
def test_greedy_tokens_match_transformers_with_cuda_graphs(family: str, tmp_path: Path) -> None:
    hf = build_tiny_moe(family, vocab_size=512)
    hf.save_pretrained(tmp_path)
    hf = hf.to(DEVICE)
    config = ModelConfig.from_dir(tmp_path)
    runner = ModelRunner(engine_config("float32", eager=False), config,
                         load_model_weights(tmp_path, "safetensors", config, "float32", device=DEVICE))
    assert runner.graphs is not None
    prompts = random_prompts([40, 7, 123], 512, seed=3)
    assert greedy(runner, prompts, 24) == [hf_greedy(hf, p, 24) for p in prompts]


@pytest.mark.parametrize("hf_config", [QWEN3_MOE_SMALL, DEEPSEEK_V2_SMALL], ids=["qwen3-moe", "deepseek-v2"])
@pytest.mark.parametrize("lengths", [[33, 5, 90, 17], [33]])  # batch 1: the alignment-free single-token path
def test_cuda_graph_decode_equals_eager_on_a_bf16_moe(hf_config: dict, lengths: list[int]) -> None:
    config = ModelConfig.from_hf_config(hf_config)
    prompts = random_prompts(lengths, 2048, seed=4)
    outputs = []
    for eager in (True, False):
        runner = ModelRunner(engine_config("bfloat16", eager=eager), config,
                             dummy_weights(config, torch.bfloat16, DEVICE, seed=1))
        assert (runner.graphs is None) == eager
        outputs.append(greedy(runner, prompts, 16))
    assert outputs[0] == outputs[1]



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="expert parallelism needs 2 GPUs")
def test_ep2_runner_generates_the_one_gpu_tokens(tmp_path: Path) -> None:
    import dataclasses
    import json

    from engine.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE_SMALL, "max_position_embeddings": 1024}))
    base = dataclasses.replace(engine_config("float32", eager=False), model=str(tmp_path), load_format="dummy",
                               seed=4)
    prompts = random_prompts([40, 7, 123], 2048, seed=7)
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    single = ModelRunner(base, loaded.model_config, loaded.weights)
    assert single.graphs is not None
    assert int(single.expert_load().sum()) == 0  # the capture's padding rows are not counted
    expected = greedy(single, prompts, 16)
    ep_config = dataclasses.replace(base, parallel=ParallelConfig(expert_parallel_size=2, timeout_s=120))
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    runner = TensorParallelRunner(ep_config, loaded.model_config, loaded.weights)
    try:
        assert runner.runner.graphs is None  # the all-to-all's counts are read on the host: eager
        got = greedy(runner, prompts, 16)
        load = runner.expert_load()
    finally:
        runner.shutdown()
    assert got == expected
    assert load is not None and int(load.sum()) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
def test_tp2_mla_runner_generates_the_one_gpu_tokens(tmp_path: Path) -> None:
    """DeepSeek-V2 latent attention with its heads over 2 GPUs (the latent replicated, the MLA Triton kernels
    on each rank's heads, NCCL all-reduce captured in CUDA graphs): greedy tokens equal one GPU's, fp32."""
    import dataclasses
    import json

    from engine.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V2_SMALL, "max_position_embeddings": 1024}))
    base = dataclasses.replace(engine_config("float32", eager=False), model=str(tmp_path), load_format="dummy",
                               seed=4)
    prompts = random_prompts([40, 7, 123], 2048, seed=7)
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    expected = greedy(ModelRunner(base, loaded.model_config, loaded.weights), prompts, 16)
    tp_config = dataclasses.replace(base, parallel=ParallelConfig(tensor_parallel_size=2, timeout_s=120))
    loaded = load_model(base.model, "dummy", "float32", "cuda", seed=base.seed)
    runner = TensorParallelRunner(tp_config, loaded.model_config, loaded.weights)
    try:
        got = greedy(runner, prompts, 16)
    finally:
        runner.shutdown()
    assert got == expected
