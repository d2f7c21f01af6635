"""The fused MoE kernel over FP8 experts, and FP8 MoE models, on a CUDA GPU.

- The compiled kernel (engine/kernels/fused_moe.py, e4m3 weights widened in registers, per-row or
  128 x 128 block scales) against the torch reference that dequantizes each expert (engine/layers/
  moe_ops.py) on the same GPU, at Qwen3-30B-A3B's MoE shape (hidden 2048, 128 experts of 768, top-8),
  bf16 activations at 1, 64 and 4096 tokens: ||fused - ref|| / ||ref|| <= 1e-2 (both accumulate the same
  e4m3 values in fp32 and round after each GEMM; only reduction order differs, as for bf16 experts).
- Every launch configuration the table or `bench_moe --sweep` can pick, over block-scaled experts (K tiles
  cut to 128), at its rows class's token count, same bound; one token replayed in a CUDA graph.
- A dummy-weight Qwen3-MoE under `--quantization fp8` in bf16: experts held in e4m3, CUDA-graph decode
  equal to eager decode.
- The tiny DeepSeek-V3 FP8 checkpoint (tests/support/fp8_checkpoints.py) through the CUDA runner with CUDA
  graphs, fp32: greedy tokens equal to the same runner on its dequantized weights (prompts of 12 tokens
  in all, so every FP8 GEMM runs weight-only and only summation order differs).

    timeout 900 pytest -m gpu tests/gpu/test_moe_fp8_gpu.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("triton")

from safetensors.torch import save_file  # noqa: E402
from test_engine_gpu import engine_config, greedy, random_prompts, rel_err  # noqa: E402
from test_moe_gpu import (  # noqa: E402
    CASES,
    EXPERTS,
    QWEN3_MOE_SMALL,
    inputs_per_class,
    moe_inputs,
    run_config_or_skip,
)

from engine.config import ModelConfig  # noqa: E402
from engine.kernels.fused_moe import fused_expert_outputs  # noqa: E402
from engine.kernels.fused_moe_configs import MoeKernelConfig, RowsPerExpert  # noqa: E402
from engine.layers.moe_ops import expert_outputs_reference, quantize_experts  # noqa: E402
from engine.loader.dummy import dummy_weights  # noqa: E402
from engine.loader.weights import load_model_weights  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.quant.fp8 import FP8_DTYPE  # noqa: E402
from tests.support.fp8_checkpoints import HF_CONFIG, write_deepseek_v3_fp8  # noqa: E402


def fp8_inputs(tokens: int, blocked: bool, seed: int) -> tuple[torch.Tensor, ...]:
    x, ids, w13, w2 = moe_inputs(tokens, torch.bfloat16, seed=seed)
    q = quantize_experts(w13.float(), w2.float(), blocked)
    return x, ids, q.w13, q.w13_scale, q.w2, q.w2_scale


def _fused(inputs: tuple[torch.Tensor, ...], config: MoeKernelConfig | None = None) -> torch.Tensor:
    x, ids, w13, w13s, w2, w2s = inputs
    return fused_expert_outputs(x, ids, w13, w2, config, w13_scale=w13s, w2_scale=w2s)


def _reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, ids, w13, w13s, w2, w2s = inputs
    return expert_outputs_reference(x, ids, w13, w2, w13s, w2s)


@pytest.mark.parametrize("blocked", [True, False], ids=["block", "row"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fp8_fused_moe_matches_the_dequantizing_reference_at_qwen3_30b_shape(tokens: int, blocked: bool) -> None:
    inputs = fp8_inputs(tokens, blocked, seed=tokens)
    got = _fused(inputs)
    assert got.shape == (tokens, 8, 2048) and got.dtype == torch.bfloat16
    assert rel_err(got, _reference(inputs)) <= 1e-2


@pytest.fixture(scope="module")
def block_class_inputs() -> dict[RowsPerExpert, tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return inputs_per_class(lambda tokens: fp8_inputs(tokens, blocked=True, seed=tokens), _reference)


@pytest.mark.parametrize(("rows", "config"), CASES, ids=lambda v: str(v.value if isinstance(v, RowsPerExpert) else v))
def test_every_config_reads_block_fp8_experts_at_its_rows_class(rows: RowsPerExpert, config: MoeKernelConfig,
                                                                 block_class_inputs: dict) -> None:
    inputs, expected = block_class_inputs[rows]
    assert rel_err(run_config_or_skip(config, lambda: _fused(inputs, config)), expected) <= 1e-2


def test_one_token_fp8_layer_replays_in_a_cuda_graph_with_new_routing() -> None:
    inputs = fp8_inputs(1, blocked=True, seed=31)
    x, ids = inputs[0].clone(), inputs[1].clone()
    weights = inputs[2:]
    _fused((x, ids, *weights))  # warm-up: compiles, makes the constant rows
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused((x, ids, *weights))
    for seed in (32, 33):
        new_x, new_ids = fp8_inputs(1, blocked=True, seed=seed)[:2]
        x.copy_(new_x)
        ids.copy_(new_ids)
        graph.replay()
        assert rel_err(out, _reference((new_x, new_ids, *weights))) <= 1e-2
    assert ids.max() < EXPERTS


@pytest.mark.parametrize("lengths", [[33, 5, 90, 17], [33]])
def test_cuda_graph_decode_equals_eager_on_an_online_fp8_moe(lengths: list[int]) -> None:
    config = ModelConfig.from_hf_config(QWEN3_MOE_SMALL)
    prompts = random_prompts(lengths, 2048, seed=4)
    outputs = []
    for eager in (True, False):
        runner = ModelRunner(engine_config("bfloat16", eager=eager, quantization="fp8"), config,
                             dummy_weights(config, torch.bfloat16, "cuda", seed=1))
        experts = runner.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale.shape == (32, 512)  # per row
        outputs.append(greedy(runner, prompts, 16))
    assert outputs[0] == outputs[1]


def test_deepseek_v3_fp8_checkpoint_gives_the_dequantized_models_tokens_with_cuda_graphs(tmp_path: Path) -> None:
    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    fp8_dir.mkdir()
    float_dir.mkdir()
    meaning = write_deepseek_v3_fp8(fp8_dir)
    save_file(meaning, str(float_dir / "model.safetensors"))
    (float_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    prompts = random_prompts([5, 7], HF_CONFIG["vocab_size"], seed=9)  # 12 tokens: weight-only prefill
    tokens = []
    for path in (fp8_dir, float_dir):
        config = ModelConfig.from_dir(path)
        runner = ModelRunner(engine_config("float32", eager=False), config,
                             load_model_weights(path, "safetensors", config, "float32", device="cuda"))
        assert runner.graphs is not None
        assert (runner.model.model.layers[1].mlp.experts.w13.dtype == FP8_DTYPE) == (path == fp8_dir)
        tokens.append(greedy(runner, prompts, 24))
    assert tokens[0] == tokens[1]
