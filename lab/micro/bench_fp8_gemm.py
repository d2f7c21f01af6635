"""Decode-size FP8 GEMMs at the 8B shape on one GPU: the Triton weight-only kernel against `_scaled_mm` with
its activation quantization and against bf16 `F.linear`, each as a share of copy bandwidth (weight bytes
read / time; the activations are negligible at these M).

Timed as the decode step runs them, replayed from a CUDA graph: eagerly, a kernel of 5-50 us is timed as its
host launch path (Triton's launcher alone is tens of microseconds; the H200 run of 2026-12-02 timed the same
one-launch quantization at 4 and at 52 us). The graph calls the GEMM on enough copies of the weight to
exceed L2 several times over, so every call reads its weight from HBM, and the time is per call.

    timeout 300 python -m lab.micro.bench_fp8_gemm --out fp8_gemm.json           # the adopted tile configs
    timeout 600 python -m lab.micro.bench_fp8_gemm --sweep --out fp8_gemm.json   # and a small config sweep

The whole-step effect is bench_decode's `--precisions bf16 fp8`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from engine.kernels.fp8_quant import quantize_activations
from engine.kernels.fp8_weight_gemm import MAX_ROWS, TileConfig, default_config, fp8_weight_gemm
from engine.quant.fp8 import _scaled_mm_blocks, _scaled_mm_rows, quantize_blocks, quantize_rows
from lab.micro.bench_decode import _copy_gb_s

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
SWEEP = [TileConfig(bn, bk, warps, st) for bn, bk, warps, st in
         itertools.product((16, 32, 64), (256, 512, 1024), (4, 8), (3, 4))]
# e4m3 activations at 16-64 rows: wider output tiles (x is re-read from L2 by every program), K split or not.
FP8_DOT_SWEEP = [TileConfig(bn, bk, 4, st, split) for bn, bk, st, split in
                 itertools.product((32, 64, 128), (128, 256), (3, 4), (0, 1))]
SPLITS = (0, 1, 2, 4, 8)  # K split over programs around the adopted tile (0: the kernel's own choice)
L2_SPAN_BYTES = 400 * 2**20  # weight copies per graph: several times any GPU's L2


def graph_ms(call: Callable[[int], object], copies: int, replays: int = 15) -> float:
    """Median time of one `call(copy)`, from a CUDA graph that runs it once on each weight copy."""
    for i in range(copies):  # compile and warm outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


def bench_shape(n: int, k: int, m: int, blocked: bool, copy_gb_s: float, sweep: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    copies = max(2, -(-L2_SPAN_BYTES // (n * k)))
    w = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    quantized = [quantize_blocks(wi) if blocked else quantize_rows(wi) for wi in w]
    scaled_mm = _scaled_mm_blocks if blocked else _scaled_mm_rows
    xq, xs = quantize_rows(x)

    def share(ms: float, bytes_per_weight: int) -> dict:
        return {"ms": ms, "of_copy": n * k * bytes_per_weight / ms / 1e6 / copy_gb_s}

    def weight_only(config: TileConfig | None) -> Callable[[int], object]:  # x in bf16, widened weight
        return lambda i: fp8_weight_gemm(x, *quantized[i], config)

    row = {"n": n, "k": k, "m": m, "scaling": "blocks" if blocked else "rows", "weight_copies": copies,
           "adopted_config": dataclasses.asdict(default_config(m, blocked)),
           "bf16": share(graph_ms(lambda i: F.linear(x, w[i]), copies), 2),
           "scaled_mm_with_quant": share(graph_ms(lambda i: scaled_mm(x, *quantized[i]), copies), 1),
           # The split of that path: the activation quantization alone, and the GEMM on pre-quantized rows.
           "activation_quant_torch_ms": graph_ms(lambda i: quantize_rows(x), 1),
           "activation_quant_ms": graph_ms(lambda i: quantize_activations(x), 1),
           "scaled_mm_alone_ms": (None if blocked else graph_ms(lambda i: torch._scaled_mm(
               xq, quantized[i][0].t(), scale_a=xs.unsqueeze(1), scale_b=quantized[i][1].unsqueeze(0),
               out_dtype=torch.bfloat16), copies)),
           "weight_only": share(graph_ms(weight_only(None), copies), 1)}
    if m <= MAX_ROWS:  # the same kernel with e4m3 activations (quantized in one launch) on the FP8 tensor cores
        group = 128 if blocked else None

        def fp8_dot(config: TileConfig | None) -> Callable[[int], object]:
            def call(i: int) -> torch.Tensor:
                xq_i, xs_i = quantize_activations(x, group)
                return fp8_weight_gemm(xq_i, *quantized[i], config, x_scale=xs_i)
            return call
        try:
            row["triton_fp8_dot"] = share(graph_ms(fp8_dot(None), copies), 1)
        except Exception as e:  # noqa: BLE001 -- a compile failure of this variant is a result, not the end of the run
            row["triton_fp8_dot"] = {"ms": float("nan"), "of_copy": float("nan"), "error": repr(e)[:300]}
        adopted = default_config(m, blocked)
        row["weight_only_by_split_k"] = {
            split: share(graph_ms(weight_only(dataclasses.replace(adopted, split_k=split)), copies), 1)["of_copy"]
            for split in SPLITS}
        if sweep and m >= 16 and "error" not in row["triton_fp8_dot"]:
            configs = [c for c in FP8_DOT_SWEEP if not blocked or c.block_k <= 128]
            row["triton_fp8_dot_top5"] = fastest_five(fp8_dot, configs, copies, share)
        if sweep and m <= 16:
            configs = [c for c in SWEEP if not blocked or 128 % c.block_k == 0]
            row["sweep_top5"] = fastest_five(weight_only, configs, copies, share)
    return row


def fastest_five(call_for: Callable[[TileConfig], Callable[[int], object]], configs: list[TileConfig],
                 copies: int, share: Callable[[float, int], dict]) -> dict[str, float]:
    """Share of copy bandwidth of the five fastest configs (those that fit in shared memory)."""
    timed = {}
    for c in configs:
        try:
            timed[f"n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}_split{c.split_k}"] = \
                graph_ms(call_for(c), copies)
        except triton.runtime.errors.OutOfResources:  # the larger tiles x stages
            continue
    return {name: share(ms, 1)["of_copy"] for name, ms in sorted(timed.items(), key=lambda t: t[1])[:5]}


def summary_line(name: str, row: dict) -> str:
    splits = " ".join(f"{k}:{v:.0%}" for k, v in row.get("weight_only_by_split_k", {}).items())
    line = (f"{row['scaling']:6s} {name:8s} m={row['m']:2d}  bf16 {row['bf16']['ms'] * 1e3:6.1f} us "
            f"({row['bf16']['of_copy']:.0%})  scaled_mm+quant {row['scaled_mm_with_quant']['ms'] * 1e3:6.1f} us "
            f"(quant {row['activation_quant_ms'] * 1e3:.1f}, torch {row['activation_quant_torch_ms'] * 1e3:.1f})  "
            f"weight-only {row['weight_only']['ms'] * 1e3:6.1f} us ({row['weight_only']['of_copy']:.0%})  "
            f"split_k {splits}  triton fp8 dot {row['triton_fp8_dot']['ms'] * 1e3:6.1f} us "
            f"({row['triton_fp8_dot']['of_copy']:.0%})")
    if "triton_fp8_dot_top5" in row:
        line += "  fp8-dot best " + " ".join(f"{n} {v:.0%}" for n, v in row["triton_fp8_dot_top5"].items())
    if "sweep_top5" in row:
        line += "  sweep best " + " ".join(f"{n} {v:.0%}" for n, v in row["sweep_top5"].items())
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="activation rows (the kernel holds up to 64; fp8.py runs it up to WEIGHT_ONLY_MAX_ROWS)")
    p.add_argument("--scalings", nargs="+", choices=["rows", "blocks"], default=["rows", "blocks"])
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs of the kernel")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    copy_gb_s = _copy_gb_s()
    report: dict = {"device": torch.cuda.get_device_name(), "copy_gb_s": copy_gb_s, "cases": []}
    for scaling, (name, (n, k)), m in itertools.product(args.scalings, SHAPES.items(), args.rows):
        row = bench_shape(n, k, m, scaling == "blocks", copy_gb_s, args.sweep)
        report["cases"].append({"shape": name, **row})
        print(summary_line(name, row), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
