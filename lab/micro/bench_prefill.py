"""Prefill throughput of the CUDA engine at Llama-3.1-8B shape, against the bf16 matmul rate measured in the same run.

    python -m lab.micro.bench_prefill --out prefill.json
    python -m lab.micro.bench_prefill --smoke --out /tmp/p.json       # CPU: code paths only

One prompt of T in {1k, 4k, 16k} tokens prefilled in one engine step (`runner.execute`: eager, the
Triton paged prefill, the LM head on the last row, sampling), dummy bf16 weights.

FLOPs = 2 * P * T (P: the layers' active matmul parameters, engine/param_count.py; norms, RoPE and
        softmax not counted)
      + 2 * hidden * vocab (the LM head, one row)
      + attention 4 * L * T^2 * d / 2 (QK^T and PV, 2 * d each per query-key pair, half the pairs
        visible under the causal mask; d = num_heads * head_dim).
achieved TFLOP/s = FLOPs / median step time; of_matmul = achieved / the measured 8192^3 bf16 rate.
`--precisions bf16 fp8`: the FP8 rows (FP8 weights + FP8 KV) count against the measured 8192^3 row-wise
scaled e4m3 `_scaled_mm` rate instead (target >= 0.6 at 4k).
Prints a table last; writes every number to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import math

import torch

from engine.batch import BatchPlan, ScheduledChunk
from engine.config import ModelConfig
from engine.param_count import count_parameters
from lab.micro.bench_decode import (
    BLOCK,
    GREEDY,
    LLAMA31_8B,
    SMOKE,
    bench_engine_config,
    environment,
    measure_ceilings,
    median_ms,
    write_model_dir,
    write_report,
)


def prefill_flops(mc: ModelConfig, tokens: int) -> dict[str, float]:
    """Matmul FLOPs over the parameters a token runs through (an MoE model's top-k experts, not all)."""
    params = count_parameters(mc)
    linear = 2.0 * params.active_layer_matmul * tokens + 2.0 * params.head
    attention = 4.0 * mc.num_layers * tokens**2 * (mc.num_heads * mc.head_dim) / 2
    return {"linear": linear, "attention": attention, "total": linear + attention}


def prefill_plan(tokens: int, num_blocks: int, vocab: int) -> BatchPlan:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
    blocks = torch.randperm(num_blocks, generator=gen)[: math.ceil(tokens / BLOCK)].tolist()
    return BatchPlan((ScheduledChunk("p", tuple(ids), 0, tuple(blocks), True, GREEDY, ids, ()),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", help="default 1024 4096 16384; 64 256 with --smoke")
    parser.add_argument("--iters", type=int, help="default 5; 2 with --smoke")
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                        help="fp8: FP8 weights + FP8 KV cache, against the measured FP8 matmul rate")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    # --smoke checks the code paths on CPU in seconds: the full shapes there take minutes and say nothing
    args.tokens = args.tokens or ([64, 256] if args.smoke else [1024, 4096, 16384])
    args.iters = args.iters or (2 if args.smoke else 5)
    model_dir = write_model_dir(SMOKE if args.smoke else LLAMA31_8B)
    env, ceilings = environment(), measure_ceilings(not args.smoke)
    rows = []
    for precision in args.precisions:
        rows += run_precision(args, model_dir, ceilings, precision)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_report(args.out, env, ceilings, rows, ["precision", "tokens", "step_ms", "tok_s", "tflop", "attn_share",
                                                 "tflop_s", "of_matmul"])


def run_precision(args: argparse.Namespace, model_dir: str, ceilings: dict, precision: str) -> list[dict]:
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    num_blocks = math.ceil(max(args.tokens) / BLOCK) + 1
    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=1, eager=True, precision=precision)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    rate = ceilings.get("fp8_matmul_tflop_s" if precision == "fp8" else "matmul_tflop_s")
    rows = []
    for tokens in args.tokens:
        plan = prefill_plan(tokens, num_blocks, loaded.model_config.vocab_size)
        step_ms = median_ms(lambda plan=plan: runner.execute(plan), args.iters, warmup=2)
        flops = prefill_flops(loaded.model_config, tokens)
        tflop_s = flops["total"] / step_ms / 1e9
        rows.append({"precision": precision, "tokens": tokens, "step_ms": step_ms, "tok_s": tokens / step_ms * 1e3,
                     "tflop": flops["total"] / 1e12, "attn_share": flops["attention"] / flops["total"],
                     "tflop_s": tflop_s, "of_matmul": tflop_s / rate if rate else None})
    return rows  # the runner goes with this frame, before the next precision's is built


if __name__ == "__main__":
    main()
