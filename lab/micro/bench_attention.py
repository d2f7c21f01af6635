"""Triton attention kernels on a CUDA GPU, against ceilings measured in the same run.

    python -m lab.micro.bench_attention --out results/attention.json [--quick]
    TRITON_INTERPRET=1 python -m lab.micro.bench_attention --smoke --out /tmp/a.json   # CPU check

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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from engine.kernels.attention_tiles import (
    MIXED_DECODE_ROWS,
    DecodeConfig,
    DecodeRows,
    PrefillConfig,
    decode_config,
    prefill_config,
)
from engine.kernels.paged_decode import paged_decode
from engine.kernels.paged_mixed import paged_mixed
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
        return self._host(fn)

    def graph(self, fn: Callable[[], object]) -> float:
        """Median per call of `fn` captured many times into one CUDA graph: the device time alone, as
        the engine's captured decode step runs it (no host launch cost, no L2 flush: the caller
        rotates its working set)."""
        if self.cuda:
            return float(triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median"))
        return self._host(fn)

    @staticmethod
    def _host(fn: Callable[[], object]) -> float:
        """One timed call: on CPU the kernels run under the Triton interpreter (seconds a launch), and the
        smoke run checks the code paths, not the speed."""
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


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
                 device: torch.device, splits: int | None = None, with_sdpa: bool = False) -> Row:
    """The default config of the shape (attention_tiles.py), timed as a CUDA-graph replay (how the
    engine runs decode) and eagerly (host launch included: `extra.eager_ms`)."""
    kv_bytes = decode_bytes(batch, ctx)
    paged = PagedBatch([ctx] * batch, layers, rotation_sets(kv_bytes), device, gen)
    query = torch.randn(batch, H_Q, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    sms = sm_count(device)
    config = decode_config(batch, H_KV, sms, ctx)
    num_splits = splits or config.num_splits(batch, H_KV, sms, ctx)
    step = decode_step(paged, query, config, num_splits)
    ms = timer.graph(step)
    gb_s = kv_bytes / ms / 1e6
    row = Row("decode", f"B={batch} ctx={ctx}", {"num_splits": num_splits, "tiles": config.label()}, ms,
              kv_bytes, gb_s, gb_s / ceilings["copy_gb_s"] if ceilings["copy_gb_s"] else None,
              extra={"eager_ms": timer(step)})
    if with_sdpa:
        sdpa = sdpa_decode_fn(paged, query)
        row.sdpa_ms = timer.graph(sdpa)
        row.extra["sdpa_eager_ms"] = timer(sdpa)
        row.max_rel_err_vs_sdpa = max_rel_err(step(0), sdpa().squeeze(2))
    return row


def decode_bytes(batch: int, ctx: int) -> int:
    """K and V bytes a decode step must read: the achieved-bandwidth numerator."""
    return batch * ctx * H_KV * HEAD_DIM * 2 * 2


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def decode_step(paged: PagedBatch, query: torch.Tensor, config: DecodeConfig,
                num_splits: int) -> Callable[..., torch.Tensor]:
    """One paged decode per call, each call on the next table set (so L2 never holds the working
    set); `step(i)` runs on table set i (set 0 is the one the SDPA reference copies)."""
    out = torch.empty_like(query)
    turn = [0]

    def step(table_set: int | None = None) -> torch.Tensor:
        table = paged.tables[(turn[0] if table_set is None else table_set) % len(paged.tables)]
        turn[0] += 1
        return paged_decode(query, paged.cache, paged.layer, table, paged.lens, HEAD_DIM**-0.5, num_splits,
                            out=out, block_n=config.block_n, num_warps=config.num_warps,
                            num_stages=config.num_stages)

    return step


def sdpa_decode_fn(paged: PagedBatch, query: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Torch SDPA of the decode step over contiguous copies of table set 0's K/V: [B, H_q, 1, D]."""
    batch = query.shape[0]
    keys = torch.stack([paged.contiguous_kv(0, i) for i in range(batch)])
    values = torch.stack([paged.contiguous_kv(1, i) for i in range(batch)])
    q = query.unsqueeze(2)  # [B, H_q, 1, D]
    return lambda: F.scaled_dot_product_attention(q, keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-row-group relative error of `out` against `ref` (same shape, first dim = unit)."""
    out, ref = out.float(), ref.float()
    return max(((out[i] - ref[i]).norm() / ref[i].norm()).item() for i in range(out.shape[0]))


def causal_flops(seq_lens: list[int], query_lens: list[int]) -> float:
    """4 * D FLOPs per (query row, visible key) pair per head: QK^T and PV, a multiply-add each."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for s, q in zip(seq_lens, query_lens, strict=True))
    return 4.0 * HEAD_DIM * H_Q * pairs


def bench_prefill(timer: Timer, name: str, seq_lens: list[int], query_lens: list[int], layers: int,
                  ceilings: dict, gen: torch.Generator, device: torch.device, with_sdpa: bool = False) -> Row:
    """The engine's default path for the batch (attention_tiles.py), timed eagerly as the engine runs it."""
    paged = PagedBatch(seq_lens, layers, 1, device, gen)
    query = torch.randn(sum(query_lens), H_Q, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
    run = prefill_runner(paged, query, query_lens, None, MIXED_DECODE_ROWS)
    ms = timer(run)
    flops = causal_flops(seq_lens, query_lens)
    tflop_s = flops / ms / 1e9
    group = H_Q // H_KV
    row = Row("prefill", name, {"tiles": prefill_config(len(query), group).label()}, ms, flops, tflop_s,
              tflop_s / ceilings["matmul_tflop_s"] if ceilings["matmul_tflop_s"] else None)
    if with_sdpa and seq_lens == query_lens and len(set(seq_lens)) == 1:
        sdpa = sdpa_prefill_fn(paged, query)
        row.sdpa_ms = timer(sdpa)
        row.max_rel_err_vs_sdpa = max_rel_err(run().view(len(seq_lens), seq_lens[0], H_Q, HEAD_DIM),
                                              sdpa().transpose(1, 2))
    return row


def prefill_runner(paged: PagedBatch, query: torch.Tensor, query_lens: list[int], config: PrefillConfig | None,
                   decode_rows: DecodeRows) -> Callable[[], torch.Tensor]:
    """One prefill/mixed attention call over table set 0, the backend's way: the prefill kernel, plus
    the varlen decode kernel for DecodeRows.DECODE_KERNEL when single-row sequences are present."""
    device = query.device
    starts = query_starts(query_lens, device)
    out = torch.empty_like(query)
    num_decode_rows = sum(1 for q_len in query_lens if q_len == 1)
    args = (query, paged.cache, paged.layer, paged.tables[0], paged.lens, starts, HEAD_DIM**-0.5)
    if decode_rows == DecodeRows.DECODE_KERNEL and num_decode_rows:
        sms, max_len = sm_count(device), max(paged.seq_lens)
        return lambda: paged_mixed(*args, num_decode_rows, sms, max_len, out=out, prefill=config)
    mode = decode_rows if num_decode_rows else DecodeRows.PREFILL_TILES  # as the backend: no decode-row branch
    return lambda: paged_prefill(*args, out=out, config=config, decode_rows=mode)


def query_starts(query_lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def sdpa_prefill_fn(paged: PagedBatch, query: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Causal SDPA on contiguous [B, H, L, D] tensors of equal-length fresh prompts, same values.

    K/V are expanded to the 32 query heads so that torch picks its flash kernel (bytes are not what
    bounds a prefill), rather than a slower path for grouped heads.
    """
    batch, length = len(paged.seq_lens), paged.seq_lens[0]
    group = H_Q // H_KV
    keys = torch.stack([paged.contiguous_kv(0, i) for i in range(batch)]).repeat_interleave(group, dim=1)
    values = torch.stack([paged.contiguous_kv(1, i) for i in range(batch)]).repeat_interleave(group, dim=1)
    q = query.view(batch, length, H_Q, HEAD_DIM).transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=HEAD_DIM**-0.5)


def plan(quick: bool, smoke: bool) -> dict:
    """The cases run: (batch, ctx) for decode; (name, seq_lens, query_lens) for prefill; split counts.
    Tile configurations are compared by `python -m lab.micro.attention_sweep`."""
    if smoke:
        return {"decode": [(2, 40)], "splits": [(1, 64, [1, 2])], "prefill": [("2x24", [24, 24], [24, 24])]}
    decode = [(64, 4096), (1, 8192), (8, 8192), (32, 2048), (128, 1024)]
    splits = [(1, 8192, [1, 4, 8, 16, 32, 64]), (8, 8192, [1, 2, 4, 8, 16])]
    prefill = [("1x8192", [8192], [8192]), ("4x2048", [2048] * 4, [2048] * 4),
               ("extend 4x512 on 4k", [4608] * 4, [512] * 4),
               ("mixed 2x1024 + 64 decodes", [3072] * 2 + [2048] * 64, [1024] * 2 + [1] * 64)]
    if quick:
        decode, splits = decode[:2], splits[:1]
    return {"decode": decode, "splits": splits, "prefill": prefill}


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
    for name, seq_lens, query_lens in cases["prefill"]:
        rows.append(bench_prefill(timer, name, seq_lens, query_lens, args.layers, ceilings, gen, device,
                                  with_sdpa=True))
    return {**environment(device, args.layers), "ceilings": ceilings, "rows": [asdict(r) for r in rows]}


def environment(device: torch.device, layers: int) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "shapes": {"h_q": H_Q, "h_kv": H_KV, "head_dim": HEAD_DIM, "block_size": BLOCK, "layers": layers,
                   "dtype": "bfloat16"},
    }


def print_table(result: dict) -> None:
    c = result["ceilings"]
    print(f"{result['device']}  {result['date']}  copy {c['copy_gb_s'] or 0:.0f} GB/s  "
          f"matmul {c['matmul_tflop_s'] or 0:.0f} TFLOP/s   (decode ms: CUDA-graph replay; eager in brackets)")
    print(f"{'kind':8}{'case':28}{'config':44}{'ms':>9}{'eager':>9}{'rate':>10}{'ceil%':>7}{'sdpa ms':>9}"
          f"{'err':>9}")
    for r in result["rows"]:
        unit = "GB/s" if r["kind"] == "decode" else "TF/s"
        cfg = ",".join(f"{k[:6]}={v}" for k, v in r["config"].items())
        eager = f"({r['extra']['eager_ms']:.3f})" if "eager_ms" in r["extra"] else "-"
        ceil = f"{100 * r['of_ceiling']:.0f}" if r["of_ceiling"] else "-"
        sdpa = f"{r['sdpa_ms']:.3f}" if r["sdpa_ms"] else "-"
        err = f"{r['max_rel_err_vs_sdpa']:.1e}" if r["max_rel_err_vs_sdpa"] is not None else "-"
        print(f"{r['kind']:8}{r['case'][:27]:28}{cfg[:43]:44}{r['ms']:9.3f}{eager:>9}{r['rate']:6.0f} {unit}"
              f"{ceil:>7}{sdpa:>9}{err:>9}")


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
