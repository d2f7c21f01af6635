"""Pipeline against tensor parallelism on 2 GPUs: Llama-3.1-70B's decode step under PP=2 and TP=2,
against the per-GPU memory floor; and greedy identity of PP=2 with PP=1 (8B shape, one GPU's worth).

    python -m lab.micro.bench_pp70b --out pp70b.json                 # 2 GPUs (H200: 70B bf16 fits)
    python -m lab.micro.bench_pp70b --smoke --out /tmp/pp.json       # CPU, gloo: code paths only
    OUT=/dir bash lab/suites/pp70b_suite.sh                           # both parts, hard time limits

Part 1, identity (`--part identity`): the 8B shape (dummy bf16 weights, seed 0) greedy-decodes 4 prompts
x 32 tokens on one process (PP=1, eager) and on 2 stages (PP=2, one micro-batch: the same kernels on
the same shapes, so bitwise the same); then PP=2 with 2 micro-batches (other GEMM shapes: bf16 may
round differently, reported, not required). The runs go one after the other on GPUs 0 (and 1).

Part 2, decode (`--part decode`): the 70B shape, dummy bf16 weights, Triton attention, KV pool for
batch 128 x context 1024 filled with random values, decode at batch 1/32/128 with every sequence at
context 1024 (bench_decode.decode_plan), for each layout in turn (one group on the 2 GPUs at a time):
- `tp2`: TensorParallelRunner, CUDA graphs (the engine's default), and `tp2-eager`;
- `pp2-mb1`, `pp2-mb2`: 2 stages of 40 layers, 1 or 2 micro-batches per step (PP runs eagerly).
Per row: step_ms (median wall time of `execute`), floor_ms = (weights / 2 + KV / 2) / copy bandwidth
of cuda:0: both GPUs busy, each reading its half once (`bench_decode.decode_bytes(..., tp=2)`);
of_floor = floor_ms / step_ms. A PP step runs its stages one after the other, so PP=2 with one
micro-batch reaches at most ~1/2 of that floor; with M micro-batches every stage re-reads its weights
M times, so in memory-bound decode micro-batching within a step buys overlap at the price of weight
reads (`mb_floor_ms`: (M + 1) slots of one stage's weights + KV / M, the schedule's own floor).
What closes the gap is several batches in flight across steps (docs/architecture.md).

Prints a "row" line per result as it completes and a table last; writes every number to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import time

import torch

from engine.batch import BatchPlan, ScheduledChunk
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.kv_cache import KVCacheSpec
from lab.micro.bench_decode import (
    BLOCK,
    GREEDY,
    LLAMA31_8B,
    RESERVE_BYTES,
    SMOKE,
    bench_engine_config,
    decode_bytes,
    environment,
    measure_ceilings,
    step_row,
    write_model_dir,
    write_report,
)
from lab.micro.bench_tp70b import LLAMA31_70B

LAYOUTS = {  # name -> (tensor, pipeline, micro-batches, eager)
    "tp2": (2, 1, None, False),
    "tp2-eager": (2, 1, None, True),
    "pp2-mb1": (1, 2, 1, True),
    "pp2-mb2": (1, 2, 2, True),
}
PROMPTS = [[(7 * i + 13 * j) % 500 + 1 for j in range(24 + 8 * i)] for i in range(4)]


def _config(model_dir: str, smoke: bool, num_blocks: int, tp: int, pp: int, microbatches: int | None,
            eager: bool, timeout_s: float) -> EngineConfig:
    base = bench_engine_config(model_dir, smoke, num_blocks, max_num_seqs=128, tp=tp, eager=eager)
    parallel = dataclasses.replace(base.parallel, pipeline_parallel_size=pp, pipeline_microbatches=microbatches,
                                   timeout_s=timeout_s)
    return dataclasses.replace(base, parallel=parallel, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks))


def _runner(config: EngineConfig):  # noqa: ANN202 - ModelRunner | TensorParallelRunner
    from engine.loader import load_model
    from engine.parallel.launcher import create_model_runner

    loaded = load_model(config.model, "dummy", config.dtype, config.device, seed=0)
    return create_model_runner(config, loaded.model_config, loaded.weights)


def _close(runner) -> None:  # noqa: ANN001
    if hasattr(runner, "shutdown"):
        runner.shutdown()
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- identity


def greedy_tokens(runner, new_tokens: int) -> list[list[int]]:  # noqa: ANN001
    """Prefill every prompt in one step, then decode them together."""
    per_seq = math.ceil((max(len(p) for p in PROMPTS) + new_tokens) / BLOCK)
    seqs = [list(p) for p in PROMPTS]
    blocks = [tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(seqs))]
    starts = [0] * len(seqs)
    for _ in range(new_tokens):
        chunks = tuple(ScheduledChunk(str(i), tuple(s[starts[i]:]), starts[i], blocks[i], True, GREEDY, (), ())
                       for i, s in enumerate(seqs))
        sampled = runner.execute(BatchPlan(chunks)).sampled
        for i, s in enumerate(seqs):
            starts[i] = len(s)
            s.append(sampled[str(i)].token_id)
    return [s[len(p):] for s, p in zip(seqs, PROMPTS, strict=True)]


def run_identity(args: argparse.Namespace) -> list[dict]:
    model_dir = write_model_dir(SMOKE if args.smoke else LLAMA31_8B)
    num_blocks = 1 + len(PROMPTS) * math.ceil((max(map(len, PROMPTS)) + args.new_tokens) / BLOCK)
    results = {}
    for name, (pp, mb) in {"pp1": (1, None), "pp2-mb1": (2, 1), "pp2-mb2": (2, 2)}.items():
        t0 = time.perf_counter()
        runner = _runner(_config(model_dir, args.smoke, num_blocks, 1, pp, mb, True, args.timeout))
        try:
            results[name] = greedy_tokens(runner, args.new_tokens)
        finally:
            _close(runner)
        print("identity", name, f"{time.perf_counter() - t0:.1f}s", flush=True)
    rows = [{"part": "identity", "layout": name, "tokens": results[name],
             "identical_to_pp1": results[name] == results["pp1"]} for name in results]
    for row in rows:
        print("row", json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return rows


# --------------------------------------------------------------------------------------------- decode


def run_decode(args: argparse.Namespace, ceilings: dict) -> list[dict]:
    hf = SMOKE if args.smoke else LLAMA31_70B
    mc = ModelConfig.from_hf_config(hf)
    model_dir = write_model_dir(hf)
    num_blocks = max(args.batches) * math.ceil(args.context / BLOCK) + 1
    rows = []
    for name in args.layouts:
        tp, pp, mb, eager = LAYOUTS[name]
        t0 = time.perf_counter()
        runner = _runner(_config(model_dir, args.smoke, num_blocks, tp, pp, mb, eager, args.timeout))
        print("loaded", name, f"{time.perf_counter() - t0:.1f}s", flush=True)
        try:
            runner.randomize_kv_cache(1)
            for batch in args.batches:
                row = step_row(runner, batch, args.context, 2, args.iters, ceilings, args.smoke)
                row.update(part="decode", layout=name, pp=pp, microbatches=mb or 1, eager=eager)
                if ceilings["copy_gb_s"] and pp > 1:
                    row["mb_floor_ms"] = _microbatch_floor_ms(mc, batch, args.context, mb or pp, ceilings)
                rows.append(row)
        finally:
            _close(runner)
    return rows


def _microbatch_floor_ms(mc: ModelConfig, batch: int, ctx: int, microbatches: int, ceilings: dict) -> float:
    """(M + 1) schedule slots (fill + drain of 2 stages), each one stage's weights + 1/M of its KV."""
    weights, kv = decode_bytes(mc, batch, ctx, 2)
    slot = (weights + kv / microbatches) / ceilings["copy_gb_s"] / 1e6
    return (microbatches + 1) * slot


def _memory_fits(args: argparse.Namespace) -> tuple[bool, str]:
    if args.smoke:
        return True, ""
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return False, f"{gpus} GPU(s) visible, need 2"
    mc = ModelConfig.from_hf_config(LLAMA31_70B)
    spec = KVCacheSpec(mc.num_layers // 2, mc.num_kv_heads, mc.head_dim, BLOCK, "bfloat16")
    need = decode_bytes(mc, 0, 0, 2)[0] + (max(args.batches) * math.ceil(args.context / BLOCK) + 1) * \
        spec.bytes_per_block + RESERVE_BYTES
    total = torch.cuda.get_device_properties(0).total_memory
    return need <= total, f"needs {need / 2**30:.1f} GiB per GPU of {total / 2**30:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--part", choices=["identity", "decode", "all"], default="all")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 32 128; 1 4 with --smoke")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default 1024; 64 --smoke)")
    parser.add_argument("--iters", type=int, default=None, help="decode steps timed per case (default 20; 2 --smoke)")
    parser.add_argument("--new-tokens", type=int, help="identity: greedy tokens per prompt (default 32; 8 --smoke)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may wait")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, gloo: checks the code, not the speed")
    args = parser.parse_args()
    args.context = args.context or (64 if args.smoke else 1024)
    args.iters = args.iters or (2 if args.smoke else 20)
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 32, 128])
    args.new_tokens = args.new_tokens or (8 if args.smoke else 32)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by every spawned rank
    env = environment()
    env.update(model="tiny (smoke)" if args.smoke else "Llama-3.1-70B shape (decode), 8B shape (identity), dummy bf16")
    columns = ["layout", "batch", "ctx", "step_ms", "floor_ms", "of_floor", "mb_floor_ms", "tok_s", "identical_to_pp1"]
    ceilings = measure_ceilings(not args.smoke)
    print("ceilings", json.dumps(ceilings), flush=True)
    rows: list[dict] = []
    try:
        if args.part in ("identity", "all"):
            rows += run_identity(args)
        if args.part in ("decode", "all"):
            fits, why = _memory_fits(args)
            if fits:
                rows += run_decode(args, ceilings)
            else:
                rows.append({"part": "decode", "skipped": why})
                print("skipped decode:", why, flush=True)
    finally:
        write_report(args.out, env, ceilings, rows, columns)


if __name__ == "__main__":
    main()
