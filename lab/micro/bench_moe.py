"""Mixture-of-experts decode and prefill of the CUDA engine at Qwen3-30B-A3B shape, against floors measured in-run.

    python -m lab.micro.bench_moe --out moe.json [--time-limit-s 480]
    python -m lab.micro.bench_moe --smoke --out /tmp/m.json          # CPU: code paths only
    python -m lab.micro.bench_moe --sweep --out sweep.json           # kernel configs first (moe_sweep.py)
    python -m lab.micro.bench_moe --precision fp8 --out moe_fp8.json  # FP8 weights (experts too) + FP8 KV
    python -m lab.micro.bench_moe --layer-only --out layer.json      # the moe_layer rows alone (no model)
    TRITON_INTERPRET=1 python -m lab.micro.bench_moe --sweep --smoke --out /tmp/s.json   # CPU

Model: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 query / 4 KV heads of 128, q/k norm, 128
experts of 768 per layer, top-8 renormalised, vocab 151936, untied; 30.5B parameters, 3.35B active),
dummy bf16 weights (~61 GB), Triton attention, the fused MoE kernel, CUDA graphs for decode.

- decode (batch {1, 64} x context 1k, KV filled with random values, contexts set directly as in
  bench_decode.py): floor_ms = (weights read + KV bytes) / the copy bandwidth timed here, where
  the weights read count the attention, router, norm and LM-head weights once plus, per layer, the
  experts this batch actually routed to (`experts_routed`: from the MoE blocks' per-expert counts
  over an eager pass of the same step; between 8 at batch 1 and 128). of_floor = floor_ms / step_ms.
  `expert_imbalance`: that pass's most loaded expert over the mean expert, worst layer (what the
  worker exports as baton_moe_expert_imbalance; random dummy weights route near-evenly).
- prefill (one prompt of 4k tokens, one eager step): FLOPs over the ACTIVE parameters (2 x active
  layer matmul parameters x T + attention + one LM-head row; engine/param_count.py);
  of_matmul = achieved TFLOP/s / the measured 8192^3 bf16 matmul rate.
- moe_layer rows: the fused expert compute of one layer alone (engine/kernels/fused_moe.py, CUDA-event
  median) at the same token counts, against its own floor (the routed experts' bytes) or FLOP rate,
  which says whether a gap is the kernel's or the rest of the step's. Three `precision`s per token
  count, same routing: bf16 experts, and e4m3 experts with 128 x 128 block scales (Qwen3-30B-A3B-FP8's
  layout) or per-row scales (`--quantization fp8`), read weight-only (one byte per weight: the floor
  halves); `vs_bf16` = bf16 time / this time.
- `--precision fp8`: the model rows with FP8 weights (attention, experts, LM head excepted; quantized
  per channel at load) and an FP8 KV cache, against the FP8 floor (bench_decode.decode_bytes).
`--sweep` first times the fused kernel's candidate configurations one by one (lab/micro/moe_sweep.py),
then runs the decode and prefill rows with the winners in the kernel's table, and prints the winners
as table lines. `--time-limit-s` is a hard limit: on expiry the rows measured so far are written with
`"timed_out": true`. Prints a table last; writes every number to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import FrameType

import torch

from engine.config import ModelConfig
from engine.layers.moe import expert_load_imbalance
from engine.param_count import count_parameters
from lab.micro.bench_decode import (
    BLOCK,
    bench_engine_config,
    decode_bytes,
    decode_plan,
    device_ms,
    environment,
    measure_ceilings,
    median_ms,
    write_model_dir,
    write_report,
)
from lab.micro.bench_prefill import prefill_flops, prefill_plan

QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
SMOKE = dict(QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32)
SMOKE_SWEEP_TOKENS = [1, 8, 300]  # one case per rows class but MIXED, at the smoke shape (8 experts, top-2)
COLUMNS = ["case", "precision", "batch", "ctx", "tokens", "step_ms", "replay_ms", "experts_routed", "expert_imbalance",
           "floor_ms", "of_floor", "replay_of_floor", "tflop_s", "of_matmul", "vs_bf16", "timed_out"]
LAYER_PRECISIONS = ("bf16", "fp8-block", "fp8-row")


class TimeLimit(Exception):
    """The run's hard time limit expired; the rows measured so far are reported."""


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeLimit(f"time limit of {seconds}s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@torch.inference_mode()
def step_routing(runner, plan) -> tuple[float, float]:  # noqa: ANN001
    """One eager pass of the step, read from the MoE blocks' per-expert counts: the distinct experts its
    tokens routed to, averaged over the sparse layers, and the worst layer's max / mean expert load."""
    before = runner.expert_load()
    inputs = runner.prepare_inputs(plan.chunks)
    runner.model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta)
    step = runner.expert_load() - before
    return float((step > 0).sum(dim=1).double().mean()), expert_load_imbalance(step)


def decode_row(runner, batch: int, ctx: int, args: argparse.Namespace, ceilings: dict) -> dict:  # noqa: ANN001
    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch * 7 + ctx)
    routed, imbalance = step_routing(runner, plan)
    step_ms = median_ms(lambda: runner.execute(plan), args.iters)
    weights, kv = decode_bytes(runner.model_config, batch, ctx, 1, experts_routed_per_layer=routed,
                               precision=args.precision)
    row = {"case": "decode", "precision": args.precision, "batch": batch, "ctx": ctx, "step_ms": step_ms,
           "experts_routed": routed, "expert_imbalance": imbalance, "weight_gb": weights / 1e9, "kv_gb": kv / 1e9}
    if runner.graphs is not None and batch <= runner.graphs.max_batch:
        with torch.inference_mode():
            runner.graphs.run(plan.chunks)
            row["replay_ms"] = device_ms(lambda: runner.graphs.replay(batch))
    if ceilings["copy_gb_s"]:
        row["floor_ms"] = (weights + kv) / ceilings["copy_gb_s"] / 1e6
        row["of_floor"] = row["floor_ms"] / step_ms
        row["replay_of_floor"] = row["floor_ms"] / row["replay_ms"] if "replay_ms" in row else None
    return row


def profile_decode(runner, batch: int, ctx: int) -> list[dict]:  # noqa: ANN001
    """Device time per kernel of the decode step, graph-replayed and eager (lab/micro/kernel_profile.py);
    a profiler failure is reported, never fatal to the run."""
    from lab.micro.kernel_profile import kernel_rows, print_kernel_rows

    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch * 7 + ctx)
    inputs = runner.prepare_inputs(plan.chunks)
    rows: list[dict] = []
    try:
        with torch.inference_mode():
            if runner.graphs is not None and batch <= runner.graphs.max_batch:
                runner.graphs.run(plan.chunks)
                rows += kernel_rows(lambda: runner.graphs.replay(batch), f"replay b={batch}")
            rows += kernel_rows(lambda: runner.model(inputs.input_ids, inputs.positions, runner.kv_cache,
                                                     inputs.meta), f"eager b={batch}")
    except Exception as e:  # the profiler is a diagnosis: its failure must not cost the measured rows
        rows.append({"case": "kernel", "profile": f"b={batch}", "kernel": f"profiler failed: {e}", "us": 0.0,
                     "share": 0.0, "calls": 0})
    print_kernel_rows(rows)
    return rows


def prefill_row(runner, tokens: int, args: argparse.Namespace, ceilings: dict) -> dict:  # noqa: ANN001
    plan = prefill_plan(tokens, runner.num_blocks, runner.model_config.vocab_size)
    step_ms = median_ms(lambda: runner.execute(plan), max(3, args.iters // 6), warmup=2)
    flops = prefill_flops(runner.model_config, tokens)
    row = {"case": "prefill", "precision": args.precision, "tokens": tokens, "step_ms": step_ms,
           "tflop": flops["total"] / 1e12, "tflop_s": flops["total"] / step_ms / 1e9}
    if ceilings["matmul_tflop_s"]:
        row["of_matmul"] = row["tflop_s"] / ceilings["matmul_tflop_s"]
    return row


def moe_layer_rows(mc: ModelConfig, tokens: int, ceilings: dict) -> list[dict]:
    """The fused expert compute of one layer (`SparseMoeBlock.experts`) alone, on random routing: bf16
    experts, then the same experts in e4m3 (block and per-row scales)."""
    from engine.kernels.fused_moe import fused_expert_outputs
    from engine.layers.moe_ops import quantize_experts, route_tokens

    moe, h = mc.moe, mc.hidden_size
    assert moe is not None
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = torch.randn(moe.num_experts, 2 * moe.intermediate_size, h, device="cuda", generator=gen) * 0.02
    w2 = torch.randn(moe.num_experts, h, moe.intermediate_size, device="cuda", generator=gen) * 0.02
    x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
    ids = route_tokens(torch.randn(tokens, moe.num_experts, device="cuda", generator=gen), moe.top_k, True).expert_ids
    routed = ids.unique().numel()
    rows = []
    for precision in LAYER_PRECISIONS:
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        if precision == "bf16":
            experts = (w13.bfloat16(), w2.bfloat16(), None, None)
        else:
            q = quantize_experts(w13, w2, blocked=precision == "fp8-block")
            experts = (q.w13, q.w2, q.w13_scale, q.w2_scale)
        run = partial(fused_expert_outputs, x, ids, experts[0], experts[1], w13_scale=experts[2], w2_scale=experts[3])
        rows.append(layer_row(mc, tokens, routed, precision, device_ms(run), ceilings))
    for row in rows:
        row["vs_bf16"] = rows[0]["step_ms"] / row["step_ms"]
    return rows


def layer_row(mc: ModelConfig, tokens: int, routed: int, precision: str, ms: float, ceilings: dict) -> dict:
    moe = mc.moe
    assert moe is not None
    expert_bytes = count_parameters(mc).expert * (2 if precision == "bf16" else 1)
    flops = 2.0 * tokens * moe.top_k * count_parameters(mc).expert
    floor_ms = routed * expert_bytes / ceilings["copy_gb_s"] / 1e6
    return {"case": "moe_layer", "precision": precision, "tokens": tokens, "step_ms": ms, "experts_routed": routed,
            "floor_ms": floor_ms, "of_floor": floor_ms / ms, "tflop_s": flops / ms / 1e9,
            "of_matmul": flops / ms / 1e9 / ceilings["matmul_tflop_s"]}


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    from engine.kernels.fused_moe_configs import table_entries

    winners = run_sweep(args, rows) if args.sweep else {}
    with table_entries(winners):
        if not args.layer_only:
            run_model(args, rows)
    if not args.smoke and not args.sweep:  # the sweep has timed the layer already, graph-captured
        torch.cuda.empty_cache()
        for tokens in (*args.batches, args.prefill):
            rows += moe_layer_rows(ModelConfig.from_hf_config(QWEN3_30B_A3B), tokens, args.ceilings)
            print("row", json.dumps(rows[-3:]), flush=True)


def run_sweep(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The kernel's configurations alone (lab/micro/moe_sweep.py); returns the winners, keyed as
    the kernel's `CONFIGS` table."""
    from engine.kernels.fused_moe_configs import table_entry
    from lab.micro.moe_sweep import MoeShape, print_sweep, require_compiled_or_interpreted, sweep

    shape = MoeShape.of(ModelConfig.from_hf_config(SMOKE if args.smoke else QWEN3_30B_A3B))
    device = "cpu" if args.smoke else "cuda"
    require_compiled_or_interpreted(device)
    tokens = args.sweep_tokens or (SMOKE_SWEEP_TOKENS if args.smoke else [1, 64, 4096])
    sweep_rows, winners = sweep(shape, tokens, args.ceilings, device, torch.float32 if args.smoke else torch.bfloat16,
                                args.sweep_max_candidates)
    args.sweep_rows += sweep_rows
    args.winner_lines += [table_entry(*key, config) for key, config in winners.items()]
    print_sweep(sweep_rows, args.winner_lines)
    return winners


def run_model(args: argparse.Namespace, rows: list[dict]) -> None:
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    model_dir = write_model_dir(SMOKE if args.smoke else QWEN3_30B_A3B)
    ceilings = args.ceilings
    num_blocks = max(max(args.batches) * math.ceil(args.context / BLOCK), math.ceil(args.prefill / BLOCK)) + 1
    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=max(args.batches),
                                 precision=args.precision)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    runner.randomize_kv_cache(seed=1)
    params = count_parameters(loaded.model_config)
    print("model", json.dumps({"total_b": params.total / 1e9, "active_b": params.active / 1e9}), flush=True)
    for batch in args.batches:
        rows.append(decode_row(runner, batch, args.context, args, ceilings))
        print("row", json.dumps(rows[-1]), flush=True)  # progress that survives the time limit
        if args.profile and not args.smoke:
            args.kernel_rows += profile_decode(runner, batch, args.context)
    rows.append(prefill_row(runner, args.prefill, args, ceilings))
    print("row", json.dumps(rows[-1]), flush=True)
    del runner, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--time-limit-s", type=int, default=480, help="hard limit; partial rows are still written")
    parser.add_argument("--sweep", action="store_true", help="time the MoE kernel's configurations first")
    parser.add_argument("--sweep-tokens", type=int, nargs="+", help="default 1 64 4096 (smoke: 1 8 300)")
    parser.add_argument("--sweep-max-candidates", type=int, default=12)
    parser.add_argument("--profile", action="store_true", help="device time per kernel of each decode step")
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                        help="the model rows' weights (fp8: experts too) and KV cache")
    parser.add_argument("--layer-only", action="store_true", help="only the moe_layer rows (bf16 and FP8 experts)")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    if args.smoke:
        args.context, args.prefill, args.iters = min(args.context, 64), min(args.prefill, 64), min(args.iters, 3)
    run_and_report(args, run, COLUMNS)


def run_and_report(args: argparse.Namespace, run_rows: Callable[[argparse.Namespace, list[dict]], None],
                   columns: list[str]) -> None:
    """Measure the ceilings, then `run_rows` (appending rows), all under `--time-limit-s`; write the report
    with whatever rows were measured (a `"timed_out"` row last when the limit struck)."""
    env = environment()
    rows: list[dict] = []
    args.sweep_rows, args.winner_lines, args.kernel_rows = [], [], []
    try:
        with time_limit(args.time_limit_s):
            args.ceilings = measure_ceilings(not args.smoke)
            run_rows(args, rows)
    except TimeLimit as e:
        print(e, flush=True)
        rows.append({"case": "-", "timed_out": True})
    write_report(args.out, env, getattr(args, "ceilings", {"copy_gb_s": None, "matmul_tflop_s": None}), rows,
                 columns)
    report = json.loads(Path(args.out).read_text())  # the sweep and the profile beside the model's rows
    Path(args.out).write_text(json.dumps({**report, "sweep": args.sweep_rows, "winners": args.winner_lines,
                                          "kernels": args.kernel_rows}, indent=2))
    if getattr(args, "sweep", False):
        from lab.micro.moe_sweep import print_sweep

        print_sweep(args.sweep_rows, args.winner_lines)


if __name__ == "__main__":
    main()
