"""The fused MoE kernel and the MoE families on a CUDA GPU.

- The compiled kernel (engine/kernels/fused_moe.py) against the torch reference expert loop on the
  same GPU, at Qwen3-30B-A3B's MoE shape (hidden 2048, 128 experts of 768, top-8): bf16 at 1, 64
  and 4096 tokens within 1e-2 as ||fused - ref|| / ||ref|| (both accumulate in fp32 and round the
  same intermediates; only reduction order differs), fp32 within 1e-4 elementwise.
- Tiny Qwen3-MoE and Mixtral checkpoints (tests/support/tiny_moe.py) through the CUDA runner with
  CUDA graphs (the fused kernel captured): greedy tokens identical to `transformers` on the GPU, fp32.
- CUDA graph decode == eager decode on a dummy-weight Qwen3-MoE in bf16 (the alignment step must
  not sync with the host, or capture fails).
- Expert parallelism over 2 GPUs (NCCL all-to-all, the fused kernel on each rank's experts): greedy
  tokens and per-expert counts equal to one GPU's (with CUDA graphs) on a dummy-weight Qwen3-MoE, fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("transformers")
require_module("triton")

from test_engine_gpu import engine_config, greedy, hf_greedy, random_prompts, rel_err  # noqa: E402

from engine.config import ModelConfig, ParallelConfig  # noqa: E402
from engine.kernels.fused_moe import _grouped_gemm_kernel, fused_expert_outputs  # noqa: E402
from engine.kernels.kv_store import is_interpreted  # noqa: E402
from engine.layers.moe_ops import expert_outputs_reference, route_tokens  # noqa: E402
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


def test_fp32_fused_moe_matches_the_reference() -> None:
    x, ids, w13, w2 = moe_inputs(200, torch.float32, seed=5)
    torch.testing.assert_close(fused_expert_outputs(x, ids, w13, w2), expert_outputs_reference(x, ids, w13, w2),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
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


def test_cuda_graph_decode_equals_eager_on_a_bf16_moe() -> None:
    config = ModelConfig.from_hf_config(QWEN3_MOE_SMALL)
    prompts = random_prompts([33, 5, 90, 17], 2048, seed=4)
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
