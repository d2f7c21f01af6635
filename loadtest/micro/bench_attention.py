"""Triton attention kernels on a CUDA GPU, against ceilings measured in the same run.

    python -m loadtest.micro.bench_attention --out results/attention.json [--quick]
    TRITON_INTERPRET=1 python -m loadtest.micro.bench_attention --smoke --out /tmp/a.json   # CPU check

Shapes are Llama-3.1-8B's (32 query heads, 8 KV heads, head_dim 128, block size 16, bf16) over a
block-major cache of `--layers` layers, one layer attended, random non-contiguous block tables.

- Ceilings: device copy bandwidth (one large copy, bytes read + written) and bf16 matmul rate
  (8192^3), both timed here with `triton.testing.do_bench` (CUDA events, median).
- Decode: achieved bandwidth = K/V bytes the step must read / median time, against the copy
  ceiling and against torch SDPA on contiguous K/V holding the same values (outputs compared).
  Sweeps batch x context, the split count and the kernel's tile configuration.
- Prefill: causal attention FLOPs (4 * D per visible query-key pair per head) / median time, against
  the matmul rate and torch SDPA (flash) on contiguous Q/K/V for fresh prompts.
Small working sets are rotated over several block tables (>= 512 MiB in all) so that repeated
runs do not measure the 50 MB L2. Prints a table last; writes every number to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from engine.kernels.paged_decode import choose_num_splits, paged_decode
from engine.kernels.paged_prefill import paged_prefill

H_Q, H_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
ROTATE_BYTES = 512 << 20


@dataclass
class Row:
    kind: str  # "decode" | "prefill"
    case: str
    config: dict
    ms: float
    work: float  # bytes (decode) or FLOPs (prefill)
    rate: float  # GB/s or TFLOP/s
    of_ceiling: float | None
    sdpa_ms: float | None = None
    max_rel_err_vs_sdpa: float | None = None
    extra: dict = field(default_factory=dict)


class Timer:
    """do_bench medians on CUDA; host-clock medians for the CPU --smoke run (numbers meaningless)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
        fn()
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)


def measure_ceilings(timer: Timer, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"copy_gb_s": None, "matmul_tflop_s": None}
    return {"copy_gb_s": _copy_gb_s(timer, device), "matmul_tflop_s": _matmul_tflop_s(timer, device)}


def _copy_gb_s(timer: Timer, device: torch.device) -> float:
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB, random (never zeros)
    dst = torch.empty_like(src)
    return 2 * (1 << 30) / timer(lambda: dst.copy_(src)) / 1e6


def _matmul_tflop_s(timer: Timer, device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / timer(lambda: a @ b) / 1e9


class PagedBatch:
    """A random paged cache plus `sets` disjoint block tables for the same sequence lengths."""

    def __init__(self, seq_lens: list[int], layers: int, sets: int, device: torch.device,
                 gen: torch.Generator) -> None:
        self.seq_lens = seq_lens
        need = [math.ceil(n / BLOCK) for n in seq_lens]
        num_blocks = sum(need) * sets + 1
        shape = (num_blocks, layers, 2, BLOCK, H_KV, HEAD_DIM)
        self.cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        ids = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        self.tables = []
        for s in range(sets):
            table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device=device)
            start = s * sum(need)
            for i, n in enumerate(need):
                table[i, :n] = ids[start:start + n]
                start += n
            self.tables.append(table)
        self.lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.layer = layers - 1

    def contiguous_kv(self, kv: int, seq: int) -> torch.Tensor:
        """Sequence `seq`'s K (kv=0) or V (kv=1) of table set 0 as [H_kv, S, D]."""
        pos = torch.arange(self.seq_lens[seq], device=self.cache.device)
        blocks = self.tables[0][seq].long()[pos // BLOCK]
        return self.cache[blocks, self.layer, kv, pos % BLOCK].transpose(0, 1)


def rotation_sets(kv_bytes: int) -> int:
    return max(1, min(64, math.ceil(ROTATE_BYTES / kv_bytes)))


def bench_decode(timer: Timer, batch: int, ctx: int, layers: int, ceilings: dict, gen: torch.Generator,
                 device: torch.device, splits: int | None = None, tiles: dict | None = None,
                 with_sdpa: bool = False) -> Row:
    kv_bytes = batch * ctx * H_KV * HEAD_DIM * 2 * 2
    paged = PagedBatch([ctx] * batch, layers, rotation_sets(kv_bytes), device, gen)
    query = torch.randn(batch, H_Q, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    num_splits = splits or choose_num_splits(batch, H_KV, sms, ctx)
    tiles = tiles or {}
    out = torch.empty_like(query)
    turn = [0]

    def step() -> None:
        table = paged.tables[turn[0] % len(paged.tables)]
        turn[0] += 1
        paged_decode(query, paged.cache, paged.layer, table, paged.lens, HEAD_DIM**-0.5, num_splits,
                     out=out, **tiles)

    ms = timer(step)
    gb_s = kv_bytes / ms / 1e6
    row = Row("decode", f"B={batch} ctx={ctx}", {"num_splits": num_splits, **tiles}, ms, kv_bytes, gb_s,
              gb_s / ceilings["copy_gb_s"] if ceilings["copy_gb_s"] else None)
    if with_sdpa:
        row.sdpa_ms, row.max_rel_err_vs_sdpa = _sdpa_decode(timer, paged, query, num_splits)
    return row


def _sdpa_decode(timer: Timer, paged: PagedBatch, query: torch.Tensor,
                 num_splits: int) -> tuple[float, float]:
    """SDPA over contiguous [B, H_kv, S, D] K/V with the same values; checks the paged output too."""
    batch = query.shape[0]
    keys = torch.stack([paged.contiguous_kv(0, i) for i in range(batch)])
    values = torch.stack([paged.contiguous_kv(1, i) for i in range(batch)])
    q = query.unsqueeze(2)  # [B, H_q, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(q, keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True)
    ms = timer(sdpa)
    ref = sdpa().squeeze(2).float()
    out = paged_decode(query, paged.cache, paged.layer, paged.tables[0], paged.lens, HEAD_DIM**-0.5,
                       num_splits).float()
    err = max(((out[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(batch))
    return ms, err


def causal_flops(seq_lens: list[int], query_lens: list[int]) -> float:
    """4 * D FLOPs per (query row, visible key) pair per head: QK^T and PV, a multiply-add each."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for s, q in zip(seq_lens, query_lens, strict=True))
    return 4.0 * HEAD_DIM * H_Q * pairs


def bench_prefill(timer: Timer, name: str, seq_lens: list[int], query_lens: list[int], layers: int,
                  ceilings: dict, gen: torch.Generator, device: torch.device, tiles: dict | None = None,
                  with_sdpa: bool = False) -> Row:
    paged = PagedBatch(seq_lens, layers, 1, device, gen)
    query = torch.randn(sum(query_lens), H_Q, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    tiles = tiles or {}
    out = torch.empty_like(query)
    run = lambda: paged_prefill(query, paged.cache, paged.layer, paged.tables[0], paged.lens, starts,
                                HEAD_DIM**-0.5, out=out, **tiles)
    ms = timer(run)
    flops = causal_flops(seq_lens, query_lens)
    tflop_s = flops / ms / 1e9
    row = Row("prefill", name, tiles, ms, flops, tflop_s,
              tflop_s / ceilings["matmul_tflop_s"] if ceilings["matmul_tflop_s"] else None)
    if with_sdpa and seq_lens == query_lens and len(set(seq_lens)) == 1:
        row.sdpa_ms, row.max_rel_err_vs_sdpa = _sdpa_prefill(timer, paged, query, out)
    return row


def _sdpa_prefill(timer: Timer, paged: PagedBatch, query: torch.Tensor,
                  out: torch.Tensor) -> tuple[float, float]:
    """Causal SDPA on contiguous [B, H, L, D] tensors of equal-length fresh prompts, same values.

    K/V are expanded to the 32 query heads so that torch picks its flash kernel (bytes are not what
    bounds a prefill), rather than a slower path for grouped heads.
    """
    batch, length = len(paged.seq_lens), paged.seq_lens[0]
    group = H_Q // H_KV
    keys = torch.stack([paged.contiguous_kv(0, i) for i in range(batch)]).repeat_interleave(group, dim=1)
    values = torch.stack([paged.contiguous_kv(1, i) for i in range(batch)]).repeat_interleave(group, dim=1)
    q = query.view(batch, length, H_Q, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=HEAD_DIM**-0.5)
    ms = timer(sdpa)
    ref = sdpa().transpose(1, 2).float()
    got = out.view(batch, length, H_Q, HEAD_DIM).float()
    err = max(((got[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(batch))
    return ms, err


def plan(quick: bool, smoke: bool) -> dict:
    """The cases run: (batch, ctx) for decode; (name, seq_lens, query_lens) for prefill; sweeps."""
    if smoke:
        return {"decode": [(2, 40)], "splits": [(1, 64, [1, 2])], "decode_tiles": [],
                "prefill": [("2x24", [24, 24], [24, 24])], "prefill_tiles": []}
    decode = [(64, 4096), (1, 8192), (8, 8192), (32, 2048), (128, 1024)]
    splits = [(1, 8192, [1, 4, 8, 16, 32]), (8, 8192, [1, 2, 4, 8])]
    decode_tiles = [{"block_n": bn, "num_warps": w, "num_stages": s}
                    for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    prefill = [("1x8192", [8192], [8192]), ("4x2048", [2048] * 4, [2048] * 4),
               ("extend 4x512 on 4k", [4608] * 4, [512] * 4),
               ("mixed 2x1024 + 64 decodes", [3072] * 2 + [2048] * 64, [1024] * 2 + [1] * 64)]
    prefill_tiles = [{"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
                     for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    if quick:
        decode, splits = decode[:2], splits[:1]
        decode_tiles, prefill_tiles = decode_tiles[:6], prefill_tiles[:4]
    return {"decode": decode, "splits": splits, "decode_tiles": decode_tiles, "prefill": prefill,
            "prefill_tiles": prefill_tiles}


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    timer = Timer(device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    cases = plan(args.quick, args.smoke)
    ceilings = measure_ceilings(timer, device)
    rows: list[Row] = []
    for batch, ctx in cases["decode"]:
        rows.append(bench_decode(timer, batch, ctx, args.layers, ceilings, gen, device, with_sdpa=True))
    for batch, ctx, options in cases["splits"]:
        rows += [bench_decode(timer, batch, ctx, args.layers, ceilings, gen, device, splits=s)
                 for s in options]
    for tiles in cases["decode_tiles"]:
        rows.append(bench_decode(timer, 64, 4096, args.layers, ceilings, gen, device, tiles=tiles))
    for name, seq_lens, query_lens in cases["prefill"]:
        rows.append(bench_prefill(timer, name, seq_lens, query_lens, args.layers, ceilings, gen, device,
                                  with_sdpa=True))
    for tiles in cases["prefill_tiles"]:
        rows.append(bench_prefill(timer, "1x8192", [8192], [8192], args.layers, ceilings, gen, device,
                                  tiles=tiles))
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "shapes": {"h_q": H_Q, "h_kv": H_KV, "head_dim": HEAD_DIM, "block_size": BLOCK, "layers": args.layers,
                   "dtype": "bfloat16"},
        "ceilings": ceilings, "rows": [asdict(r) for r in rows],
    }


def print_table(result: dict) -> None:
    c = result["ceilings"]
    print(f"{result['device']}  {result['date']}  copy {c['copy_gb_s'] or 0:.0f} GB/s  "
          f"matmul {c['matmul_tflop_s'] or 0:.0f} TFLOP/s")
    print(f"{'kind':8}{'case':28}{'config':44}{'ms':>9}{'rate':>10}{'ceil%':>7}{'sdpa ms':>9}{'err':>9}")
    for r in result["rows"]:
        unit = "GB/s" if r["kind"] == "decode" else "TF/s"
        cfg = ",".join(f"{k[:6]}={v}" for k, v in r["config"].items())
        ceil = f"{100 * r['of_ceiling']:.0f}" if r["of_ceiling"] else "-"
        sdpa = f"{r['sdpa_ms']:.3f}" if r["sdpa_ms"] else "-"
        err = f"{r['max_rel_err_vs_sdpa']:.1e}" if r["max_rel_err_vs_sdpa"] is not None else "-"
        print(f"{r['kind']:8}{r['case'][:27]:28}{cfg[:43]:44}{r['ms']:9.3f}{r['rate']:6.0f} {unit}{ceil:>7}"
              f"{sdpa:>9}{err:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--layers", type=int, default=2, help="layers in the block-major cache")
    parser.add_argument("--quick", action="store_true", help="fewer cases and configurations")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on CPU (run with TRITON_INTERPRET=1): checks the script, not speed")
    args = parser.parse_args()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
