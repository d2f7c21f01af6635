"""DeepSeek-V2-Lite decode (MLA over the latent cache + grouped-routed MoE) on the CUDA engine, against a
memory floor measured in the same run.

    python -m lab.micro.bench_mla --out mla.json [--time-limit-s 480]
    python -m lab.micro.bench_mla --smoke --out /tmp/m.json          # CPU: code paths only

Model: DeepSeek-V2-Lite's shape (27 layers, hidden 2048, 16 heads, MLA with kv_lora_rank 512 + rope 64,
no q_lora; layer 0 dense, then 64 routed experts of 1408 (top-6, softmax) + 2 shared per layer; vocab
102400; ~15.7B parameters, ~2.7B active), dummy bf16 weights from a config.json written here (~31 GB),
Triton attention (the MLA decode kernel), the fused MoE kernel, CUDA graphs for decode.

- decode (batch {1, 64} x context 4k, the latent cache filled with random values, contexts set directly as
  in bench_decode.py): floor_ms = (weights read + latent KV read) / the copy bandwidth timed here. Weights
  read: attention (MLA's projections, kv_b_proj once: the absorbed decode reads it as W_UK and W_UV),
  dense layer, routers, shared experts, norms and LM head once, plus per sparse layer the experts this
  batch actually routed to (`experts_routed`, from the MoE blocks' counts over an eager pass of the same
  step). KV: batch x ctx x 27 layers x 576 x 2 B (31,104 B per token; a GQA 8B model reads 131,072).
  of_floor = floor_ms / step_ms (host clock, whole engine step); replay_of_floor the same for the CUDA
  graph replay alone (device clock).
- mla_kernel rows: the MLA decode kernel of one layer alone (engine/kernels/mla_decode.py) at the same
  batch and context, against its own floor (the latents it reads), which says whether a gap is the
  attention kernel's or the rest of the step's; one row per tile shape of KERNEL_TILES (the first is the
  engine's default), so a better default shows up in the same run.
`--time-limit-s` is a hard limit: on expiry the rows measured so far are written with `"timed_out": true`.
Prints a table last; writes every number to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from engine.kv_cache import KVCacheSpec
from engine.param_count import count_parameters
from lab.micro.bench_decode import (
    BLOCK,
    bench_engine_config,
    decode_plan,
    device_ms,
    median_ms,
    write_model_dir,
)
from lab.micro.bench_moe import run_and_report, step_routing

DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001,
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
    first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0)
SMOKE = dict(DEEPSEEK_V2_LITE, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
             v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32)
COLUMNS = ["case", "batch", "ctx", "block_n", "num_warps", "step_ms", "replay_ms", "experts_routed", "weight_gb",
           "kv_gb", "floor_ms", "of_floor", "replay_of_floor", "timed_out"]


def decode_floor_bytes(runner, batch: int, ctx: int, routed: float) -> tuple[float, float]:  # noqa: ANN001
    """(weight bytes, latent KV bytes) one decode step reads (module docstring)."""
    spec: KVCacheSpec = runner.kv_spec
    elem = spec.bytes_per_token // (spec.num_layers * spec.planes * spec.num_kv_heads * spec.head_dim)
    mc = runner.model_config
    weights = count_parameters(mc).weights_read(routed) * elem + batch * mc.hidden_size * elem
    return weights, batch * ctx * spec.bytes_per_token


def decode_row(runner, batch: int, ctx: int, args: argparse.Namespace, ceilings: dict) -> dict:  # noqa: ANN001
    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch * 7 + ctx)
    routed, _ = step_routing(runner, plan)
    step_ms = median_ms(lambda: runner.execute(plan), args.iters)
    weights, kv = decode_floor_bytes(runner, batch, ctx, routed)
    row = {"case": "decode", "batch": batch, "ctx": ctx, "step_ms": step_ms, "experts_routed": routed,
           "weight_gb": weights / 1e9, "kv_gb": kv / 1e9}
    if runner.graphs is not None and batch <= runner.graphs.max_batch:
        with torch.inference_mode():
            runner.graphs.run(plan.chunks)
            row["replay_ms"] = device_ms(lambda: runner.graphs.replay(batch))
    if ceilings["copy_gb_s"]:
        row["floor_ms"] = (weights + kv) / ceilings["copy_gb_s"] / 1e6
        row["of_floor"] = row["floor_ms"] / step_ms
        row["replay_of_floor"] = row["floor_ms"] / row["replay_ms"] if "replay_ms" in row else None
    return row


# (block_n, num_warps) tried for the kernel rows; the engine runs mla_decode's defaults (32, 4).
KERNEL_TILES = ((32, 4), (16, 4), (32, 8), (64, 8))


def mla_kernel_row(runner, batch: int, ctx: int, ceilings: dict, block_n: int, num_warps: int) -> dict:  # noqa: ANN001
    """One layer's MLA decode kernel alone over the runner's (random) latent cache, at one tile shape."""
    from engine.kernels.mla_decode import mla_decode
    from engine.kernels.paged_decode import choose_num_splits

    mla = runner.model_config.mla
    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch * 7 + ctx)
    meta = runner.prepare_inputs(plan.chunks).meta
    query = torch.randn(batch, runner.model_config.num_heads, mla.latent_dim, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, 1, sms, ctx)
    ms = device_ms(lambda: mla_decode(query, runner.kv_cache, 1, meta.block_tables, meta.seq_lens,
                                      mla.softmax_scale, mla.kv_lora_rank, splits, block_n=block_n,
                                      num_warps=num_warps))
    kv = batch * ctx * mla.latent_dim * 2
    floor = kv / ceilings["copy_gb_s"] / 1e6
    return {"case": "mla_kernel", "batch": batch, "ctx": ctx, "step_ms": ms, "kv_gb": kv / 1e9, "floor_ms": floor,
            "of_floor": floor / ms, "num_splits": splits, "block_n": block_n, "num_warps": num_warps}


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    model_dir = write_model_dir(SMOKE if args.smoke else DEEPSEEK_V2_LITE)
    ceilings = args.ceilings
    num_blocks = max(args.batches) * math.ceil(args.context / BLOCK) + 1
    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=max(args.batches))
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    runner.randomize_kv_cache(seed=1)
    params = count_parameters(loaded.model_config)
    print("model", json.dumps({"total_b": params.total / 1e9, "active_b": params.active / 1e9,
                               "kv_bytes_per_token": runner.kv_spec.bytes_per_token}), flush=True)
    for batch in args.batches:
        rows.append(decode_row(runner, batch, args.context, args, ceilings))
        print("row", json.dumps(rows[-1]), flush=True)  # progress that survives the time limit
    if not args.smoke:
        for batch in args.batches:
            for block_n, num_warps in KERNEL_TILES:
                rows.append(mla_kernel_row(runner, batch, args.context, ceilings, block_n, num_warps))
                print("row", json.dumps(rows[-1]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--time-limit-s", type=int, default=480, help="hard limit; partial rows are still written")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    if args.smoke:
        args.context, args.iters = min(args.context, 64), min(args.iters, 3)
    run_and_report(args, run, COLUMNS)


if __name__ == "__main__":
    main()
