"""Where a decode step's device time goes: per-kernel times of one graph replay, and each GEMM shape's
bandwidth against the device copy ceiling. The evidence behind the decode fusions (docs/benchmarks.md).

    python -m lab.micro.profile_decode --batches 1 64 --ctx 1024 --out prof.json

Model: bench_decode's Llama-3.1-8B shape with dummy bf16 weights and CUDA graphs. For each batch the
graph is replayed under torch.profiler (CUDA activity only) and the kernels are grouped by name, in
microseconds per step. The GEMM table times `F.linear` on random bf16 data (do_bench, L2 flushed) for
the layer and LM-head shapes at M = 1, 16, 64: `of_copy` = (weight + activation bytes) / time / copy
bandwidth, where 1.0 is a GEMM that moves its bytes as fast as a device-to-device copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.micro.bench_decode import (
    BLOCK,
    LLAMA31_8B,
    bench_engine_config,
    decode_bytes,
    decode_plan,
    device_ms,
    environment,
    measure_ceilings,
    write_model_dir,
)

# (name, in_features, out_features) of Llama-3.1-8B's decode GEMMs; gate_up and qkv are merged.
GEMM_SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
               ("lm_head", 4096, 128256))
STEPS = 5


def kernel_table(runner, batch: int, ctx: int) -> list[dict]:  # noqa: ANN001
    """Per-kernel device time (µs per step) of `batch`'s decode graph, largest first."""
    from torch.profiler import ProfilerActivity, profile

    plan = decode_plan(batch, ctx, runner.num_blocks, seed=batch)
    with torch.inference_mode():
        runner.graphs.run(plan.chunks)
        for _ in range(3):
            runner.graphs.replay(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                runner.graphs.replay(batch)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += event.device_time / STEPS
            entry[1] += 1 / STEPS
    rows = [{"kernel": k, "us": v[0], "calls": v[1]} for k, v in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def gemm_table(copy_gb_s: float, batches: tuple[int, ...] = (1, 16, 64)) -> list[dict]:
    rows = []
    for name, k, n in GEMM_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = device_ms(lambda x=x, w=w: F.linear(x, w))
            moved = (n * k + m * k + m * n) * 2
            rows.append({"gemm": name, "m": m, "us": ms * 1e3, "gb_s": moved / ms / 1e6,
                         "of_copy": moved / ms / 1e6 / copy_gb_s})
        del w
    return rows


def main() -> None:
    from engine.config import CacheConfig
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--skip-gemms", action="store_true")
    args = parser.parse_args()
    ceilings = measure_ceilings(True)
    model_dir = write_model_dir(LLAMA31_8B)
    num_blocks = max(args.batches) * (args.ctx // BLOCK + 1) + 1
    config = bench_engine_config(model_dir, False, num_blocks, max_num_seqs=max(args.batches))
    config = dataclasses.replace(config, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks))
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    runner.randomize_kv_cache(seed=1)
    report: dict = {"environment": environment(), "ceilings": ceilings, "kernels": {}}
    for batch in args.batches:
        table = kernel_table(runner, batch, args.ctx)
        report["kernels"][batch] = table
        weights, kv = decode_bytes(loaded.model_config, batch, args.ctx, 1)
        floor_us = (weights + kv) / ceilings["copy_gb_s"] / 1e3
        print(f"\nbatch {batch} ctx {args.ctx}: kernels {sum(r['us'] for r in table):.0f} us/step, "
              f"{sum(r['calls'] for r in table):.0f} launches, floor {floor_us:.0f} us")
        for row in table[: args.top]:
            print(f"{row['us']:9.1f} us {row['calls']:5.0f}x  {row['kernel']}")
    del runner, loaded
    torch.cuda.empty_cache()
    if not args.skip_gemms:
        report["gemms"] = gemm_table(ceilings["copy_gb_s"])
        print(f"\ncopy {ceilings['copy_gb_s']:.0f} GB/s")
        for row in report["gemms"]:
            print(f"{row['gemm']:>8} M={row['m']:<3} {row['us']:8.1f} us {row['gb_s']:6.0f} GB/s "
                  f"{row['of_copy']:.0%} of copy")
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
