"""Decode step time of the CUDA engine at Llama-3.1-8B shape, against the memory floor measured in the same run.

    python -m lab.micro.bench_decode --out decode.json [--tp 2]
    python -m lab.micro.bench_decode --smoke --out /tmp/d.json        # CPU: code paths only

Model: Llama-3.1-8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab
128256, untied), dummy bf16 weights, Triton attention, CUDA graphs (the engine's decode path).

Cases: batch {1, 16, 64, 128} x context {1k, 4k}. The KV pool is filled with random values and each
sequence's context is set directly (no prefill): the step decodes one token at position ctx - 1 over
`ctx` cached tokens in shuffled, non-contiguous blocks. A case whose KV does not fit beside the
weights is reported as skipped (128 x 4k is 64 GiB of KV: not on an 80 GB card).

- floor_ms = (weight bytes + KV bytes read) / copy bandwidth, the copy timed here (1 GiB, bytes read
  plus written). Weight bytes: every layer matrix, the norms and the LM head (the embedding: only
  the B rows looked up). KV bytes: B * ctx * layers * 2 * kv_heads * head_dim * 2.
- step_ms: wall time of `runner.execute(plan)`: host staging, copies, graph replay, sampling, the
  token read-back. Median of many steps.
- replay_ms: the captured graph alone (do_bench median, CUDA events): the device's share of a step.
- of_floor = floor_ms / step_ms: 1.0 is the memory floor; target >= 0.75 at batch 64, context 1k.
FP8 (`--precisions bf16 fp8`): the same cases again with FP8 weights (dummy bf16 weights quantized per
channel at load, `--quantization fp8`) over an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`), in the same
run; its floor counts the projections and the KV at 1 byte (embedding rows, norms and LM head stay
bf16), and `tok_s_vs_bf16` is its tokens/s over the bf16 row of the same case (target >= 1.6 at batch 1).
`BATON_FUSED_KERNELS=0` measures the unfused decoder (torch elementwise ops) for a before/after.
TP (`--tp 2`, skipped with fewer GPUs): batch 64 at 1k and 4k over 2 ranks (NCCL, NVLink multicast
off); floor per rank (half the weights and KV), and speed-up = TP=1 step_ms / TP=2 step_ms.
Prints a table last; writes every number to `--out` as JSON. The other GPU benchmarks import the
shared pieces (model shape, ceilings, report) from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.batch import BatchPlan, ScheduledChunk
from engine.config import BatcherConfig, CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from engine.kernels.dispatch import fused_kernels_enabled
from engine.kv_cache import KVCacheSpec
from engine.param_count import count_parameters
from engine.sampling_params import SamplingParams
from lab.micro.fp8_passes import fp8_dot_rows

LLAMA31_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=8192))
SMOKE = dict(LLAMA31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384)
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
RESERVE_BYTES = 6 << 30  # beside weights and KV: graph pools, activations, logits, the CUDA context


# ----------------------------------------------------------------------------- shared by the benchmarks


def write_model_dir(hf_config: dict) -> str:
    """A directory holding only config.json: the engine's `load_format="dummy"` input."""
    path = tempfile.mkdtemp(prefix="baton-bench-")
    Path(path, "config.json").write_text(json.dumps(hf_config))
    return path


def bench_engine_config(model_dir: str, smoke: bool, num_blocks: int, max_num_seqs: int = 128,
                        tp: int = 1, eager: bool = False, precision: str = "bf16") -> EngineConfig:
    """bf16 + triton + CUDA graphs on CUDA; float32 + torch reference on CPU (--smoke). `precision`
    "fp8": FP8 weights (quantized at load) and an FP8 KV cache."""
    fp8 = precision == "fp8"
    return EngineConfig(
        model=model_dir, load_format="dummy", dtype="float32" if smoke else "bfloat16",
        device="cpu" if smoke else "cuda", attention_backend="torch" if smoke else "triton",
        quantization="fp8" if fp8 else None,
        enforce_eager=eager, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                                               kv_cache_dtype="fp8_e4m3" if fp8 else "auto"),
        batcher=BatcherConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(16384, max_num_seqs)),
        parallel=ParallelConfig(tensor_parallel_size=tp, timeout_s=300),
    )


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Host-clock median; `fn` must end with a device sync (the engine's step does: it reads tokens)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def device_ms(fn: Callable[[], object]) -> float:
    """CUDA-event median of `fn` (triton's do_bench: warm-up, L2 flush between runs)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def measure_ceilings(cuda: bool) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 matmul rate, on random data."""
    if not cuda:
        return {"copy_gb_s": None, "matmul_tflop_s": None}
    ceilings = {"copy_gb_s": _copy_gb_s(), "matmul_tflop_s": _matmul_tflop_s(),
                "fp8_matmul_tflop_s": _fp8_matmul_tflop_s()}
    torch.cuda.empty_cache()
    return ceilings


def _copy_gb_s() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB: far past the 50 MB L2
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / device_ms(lambda: dst.copy_(src)) / 1e6


def _matmul_tflop_s() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / device_ms(lambda: a @ b) / 1e9


def _fp8_matmul_tflop_s() -> float | None:
    """Row-wise scaled e4m3 GEMM (`torch._scaled_mm`, what FP8 projections run); None before SM89."""
    if torch.cuda.get_device_capability() < (8, 9):
        return None
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    ms = device_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return 2 * 8192**3 / ms / 1e9


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "host": platform.node(),
        "fused_kernels": fused_kernels_enabled(),  # BATON_FUSED_KERNELS=0: the unfused "before"
    }


def write_report(out: str, env: dict, ceilings: dict, rows: list[dict], columns: list[str]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"environment": env, "ceilings": ceilings, "rows": rows}, indent=2))
    print(f"\n{env['device']}  copy {_fmt(ceilings['copy_gb_s'])} GB/s  "
          f"matmul {_fmt(ceilings['matmul_tflop_s'])} TFLOP/s  ({env['date']})")
    print("  ".join(f"{c:>12}" for c in columns))
    for row in rows:
        print("  ".join(f"{_fmt(row.get(c)):>12}" for c in columns))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


# ------------------------------------------------------------------------------------------- decode


def decode_bytes(mc: ModelConfig, batch: int, ctx: int, tp: int, elem: int = 2,
                 experts_routed_per_layer: float | None = None, precision: str = "bf16") -> tuple[float, float]:
    """(weight bytes, KV bytes) one rank reads in a decode step (see the module docstring); an MoE
    model's experts count as many per layer as the batch routed to (None: all of them). "fp8": the
    attention and dense MLP projections, the routed and shared experts and the KV at one byte a value
    (the routers stay in `elem`; scales are left out: < 0.1% of the bytes)."""
    params = count_parameters(mc)
    read = params.weights_read(experts_routed_per_layer)
    weights = read * elem / tp + batch * mc.hidden_size * elem
    kv_elem = elem
    if precision == "fp8":
        routers = params.sparse_layers * mc.moe.num_experts * mc.hidden_size if mc.moe else 0
        experts_read = read - params.attention - params.dense_mlp - params.shared - params.norms - params.head
        fp8 = params.attention + params.dense_mlp + experts_read + params.shared - routers
        weights -= fp8 * (elem - 1) / tp
        kv_elem = 1
    kv = batch * ctx * mc.num_layers * 2 * max(1, mc.num_kv_heads // tp) * mc.head_dim * kv_elem
    return weights, kv


def decode_plan(batch: int, ctx: int, num_blocks: int, seed: int) -> BatchPlan:
    """`batch` sequences of `ctx` cached tokens each, over distinct shuffled blocks."""
    per_seq = math.ceil(ctx / BLOCK)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: batch * per_seq].tolist()
    tokens = torch.randint(0, 500, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    return BatchPlan(tuple(
        ScheduledChunk(f"s{i}", (tokens[i],), ctx - 1, tuple(ids[i * per_seq:(i + 1) * per_seq]), True, GREEDY, (), ())
        for i in range(batch)))


def plan_cases(args: argparse.Namespace, spec: KVCacheSpec, weight_bytes: float) -> tuple[list, list, int]:
    """Split the cases into those whose KV fits the card and the rest; size the pool for the largest."""
    cases = [(b, c) for c in args.contexts for b in args.batches]
    budget = (torch.cuda.mem_get_info()[0] - weight_bytes - RESERVE_BYTES) if torch.cuda.is_available() else 1 << 40
    need = {case: case[0] * math.ceil(case[1] / BLOCK) for case in cases}
    fits = [c for c in cases if need[c] * spec.bytes_per_block <= budget]
    skipped = [c for c in cases if c not in fits]
    return fits, skipped, max((need[c] for c in fits), default=1) + 1


def step_row(runner, batch: int, ctx: int, tp: int, iters: int, ceilings: dict, smoke: bool,  # noqa: ANN001
             precision: str = "bf16") -> dict:
    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch * 7 + ctx)
    step_ms = median_ms(lambda: runner.execute(plan), iters)
    weights, kv = decode_bytes(runner.model_config, batch, ctx, tp, precision=precision)
    row = {"tp": tp, "precision": precision, "batch": batch, "ctx": ctx, "step_ms": step_ms,
           "weight_gb": weights / 1e9,
           "kv_gb": kv / 1e9, "tok_s": batch / step_ms * 1e3}
    graphs = getattr(runner, "graphs", None)
    if graphs is not None and not smoke and batch <= graphs.max_batch:
        with torch.inference_mode():  # the graphs' outputs are inference tensors
            graphs.run(plan.chunks)  # load this case's inputs, then time replays alone
            row["replay_ms"] = device_ms(lambda: graphs.replay(batch))
    if ceilings["copy_gb_s"]:
        row["floor_ms"] = (weights + kv) / ceilings["copy_gb_s"] / 1e6
        row["of_floor"] = row["floor_ms"] / step_ms
        row["replay_of_floor"] = row["floor_ms"] / row["replay_ms"] if "replay_ms" in row else None
    print("row", json.dumps(row), flush=True)  # progress that survives a time limit
    return row


def run_single(args: argparse.Namespace, model_dir: str, ceilings: dict, precision: str = "bf16") -> list[dict]:
    from engine.kv_cache import kv_dtype_name
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    config = bench_engine_config(model_dir, args.smoke, num_blocks=2, max_num_seqs=max(args.batches),
                                 precision=precision)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    spec = KVCacheSpec(loaded.model_config.num_layers, loaded.model_config.num_kv_heads,
                       loaded.model_config.head_dim, BLOCK, kv_dtype_name(config.dtype, config.cache.kv_cache_dtype))
    # The budget keeps bf16 weight bytes even for FP8: the load quantizes from a bf16 model built first.
    fits, skipped, num_blocks = plan_cases(args, spec, sum(decode_bytes(loaded.model_config, 0, 0, 1)))
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=num_blocks))
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    runner.randomize_kv_cache(seed=1)
    rows = [step_row(runner, b, c, 1, args.iters, ceilings, args.smoke, precision) for b, c in fits]
    for b, c in skipped:
        gib = b * math.ceil(c / BLOCK) * spec.bytes_per_block / 2**30
        rows.append({"tp": 1, "precision": precision, "batch": b, "ctx": c, "skipped": f"KV needs {gib:.0f} GiB"})
    del runner, loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def run_tensor_parallel(args: argparse.Namespace, model_dir: str, ceilings: dict, single: list[dict],
                        eager: bool) -> list[dict]:
    """Every batch at the first context over `args.tp` ranks (rank 0 here, the others spawned), with
    decode CUDA graphs (NCCL collectives captured) or eagerly; speed-up against TP=1's graph rows."""
    from engine.loader import load_model
    from engine.parallel.launcher import TensorParallelRunner

    ctx = args.contexts[0]
    cases = [(b, ctx) for b in args.batches if any(r["batch"] == b and r["ctx"] == ctx and "step_ms" in r
                                                  for r in single)]
    num_blocks = max(b * math.ceil(c / BLOCK) for b, c in cases) + 1
    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=max(args.batches), tp=args.tp,
                                 eager=eager)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    start = time.perf_counter()
    runner = TensorParallelRunner(config, loaded.model_config, loaded.weights)
    print("tp runner ready", json.dumps({"eager": eager, "start_s": time.perf_counter() - start}), flush=True)
    try:
        runner.randomize_kv_cache(1)
        rows = [step_row(runner, b, c, args.tp, args.iters, ceilings, args.smoke)
                for b, c in cases]
    finally:
        runner.shutdown()
    for row in rows:
        base = next(r for r in single if r["batch"] == row["batch"] and r["ctx"] == row["ctx"])
        row["mode"] = "eager" if eager else "graphs"
        row["speedup_vs_tp1"] = base["step_ms"] / row["step_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1, help="also run batch 64 over this many GPUs (skipped if fewer)")
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 16 64 128; 1 4 with --smoke")
    parser.add_argument("--contexts", type=int, nargs="+", help="default 1024 4096; 64 with --smoke")
    parser.add_argument("--iters", type=int, help="default 30; 2 with --smoke")
    parser.add_argument("--tp-modes", nargs="+", choices=["graphs", "eager"], default=["graphs"],
                        help="TP runs: with decode CUDA graphs and/or eagerly (each its own group)")
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                        help="fp8: FP8 weights + FP8 KV cache, each case beside bf16's in the same run")
    parser.add_argument("--fp8-dot-max-rows", type=int, default=0,
                        help="also run FP8, steps of up to this many tokens through the Triton e4m3-activation GEMM")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    # --smoke checks the code paths on CPU in seconds: the full shapes there take minutes and say nothing
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 16, 64, 128])
    args.contexts = args.contexts or ([64] if args.smoke else [1024, 4096])
    args.iters = args.iters or (2 if args.smoke else 30)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    model_dir = write_model_dir(SMOKE if args.smoke else LLAMA31_8B)
    env, ceilings = environment(), measure_ceilings(not args.smoke)
    rows = [row for precision in args.precisions for row in run_single(args, model_dir, ceilings, precision)]
    if args.fp8_dot_max_rows:
        with fp8_dot_rows(args.fp8_dot_max_rows):
            rows += [{**row, "precision": f"fp8 dot<={args.fp8_dot_max_rows}"}
                     for row in run_single(args, model_dir, ceilings, "fp8")]
    compare_precisions(rows)
    gpus = torch.cuda.device_count() if not args.smoke else args.tp
    if args.tp > 1 and gpus >= args.tp:
        single = [r for r in rows if r.get("precision") == "bf16"]  # TP runs bf16
        for mode in args.tp_modes:
            rows += run_tensor_parallel(args, model_dir, ceilings, single, eager=mode == "eager")
    elif args.tp > 1:
        rows.append({"tp": args.tp, "skipped": f"{gpus} GPU(s) visible"})
    write_report(args.out, env, ceilings, rows, ["tp", "precision", "mode", "batch", "ctx", "step_ms", "replay_ms",
                                                 "floor_ms", "of_floor", "replay_of_floor", "tok_s", "tok_s_vs_bf16",
                                                 "speedup_vs_tp1", "skipped"])


def compare_precisions(rows: list[dict]) -> None:
    """`tok_s_vs_bf16` on every FP8 row whose case also ran in bf16."""
    bf16 = {(r["batch"], r["ctx"]): r["tok_s"] for r in rows if r.get("precision") == "bf16" and "tok_s" in r}
    for row in rows:
        if str(row.get("precision")).startswith("fp8") and (row["batch"], row["ctx"]) in bf16 and "tok_s" in row:
            row["tok_s_vs_bf16"] = row["tok_s"] / bf16[(row["batch"], row["ctx"])]


if __name__ == "__main__":
    main()
