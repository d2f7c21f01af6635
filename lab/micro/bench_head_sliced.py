"""What a head-sliced KV hand-off (heterogeneous TP: a TP1 prefill feeding a TP-d decode) costs over NIXL,
against the whole-block WRITE of equal TP sizes, in one process.

    python -m lab.micro.bench_head_sliced --out head_sliced.json          # GPU: VRAM on cuda:0
    python -m lab.micro.bench_head_sliced --smoke --out /tmp/hs.json      # CPU: DRAM, tiny shapes

Shape: Llama-3.1-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16, block 16; 2 MiB blocks), `--blocks`
blocks (64 = a 1k-token prompt). The prefill agent holds every head; the decode side is `--decode-tp`
agents of H/d heads each (all on the same device: this measures the descriptor cost, not the link).
Cases, each timed from `sender.start()` to DONE through `sender.poll()` (median of `--iters`):
- whole: one WRITE of whole blocks into a decode agent of the same TP size (1 descriptor per block,
  merged by NIXL when contiguous);
- sliced: d WRITEs, one per decode rank, each with one descriptor per (layer, K/V, token) row of every
  block (kvtransfer/nixl/sliced.py): 2 * layers * block_size descriptors per block and rank.
Every case first checks the destination bit for bit. Exit code 0 only if every destination matched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import uuid

import torch

from engine.kv_cache import KVCacheSpec
from kvtransfer.base import TransferPlan
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVSender

GPU_SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
SMOKE_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, dtype="float32")


def _agent(role: str, spec: KVCacheSpec, blocks: int, device: str, tp: int, rank: int) -> NixlAgent:
    kv = spec.allocate(blocks, device)
    layout = KVLayoutInfo.from_spec(spec, "bench", tp_size=tp, tp_rank=rank)
    # Passive decode targets progress on NIXL's thread (nothing else polls them here).
    config = NixlAgentConfig(name=f"{role}-{uuid.uuid4().hex[:8]}", progress_thread=role != "prefill")
    return NixlAgent(config, kv, layout)


def _time_writes(sender: NixlKVSender, peer: str, blocks: int, iters: int) -> list[float]:
    out = []
    for i in range(iters):
        plan = TransferPlan.create(f"r{i}-{uuid.uuid4().hex[:6]}", range(blocks), range(blocks),
                                   now=time.monotonic(), timeout_s=60.0)
        start = time.perf_counter()
        transfer = sender.start(peer, plan)
        while not transfer.state.is_terminal:
            sender.poll()
        out.append(time.perf_counter() - start)
        if transfer.state.value != "done":
            raise RuntimeError(f"WRITE ended {transfer.state.value}: {transfer.reason}")
    return out


def run_case(case: str, spec: KVCacheSpec, d: int, blocks: int, device: str, iters: int) -> dict[str, object]:
    prefill = _agent("prefill", spec, blocks, device, 1, 0)
    prefill.kv_cache.copy_(torch.randn(prefill.kv_cache.shape, device=device).to(prefill.kv_cache.dtype))
    tp = 1 if case == "whole" else d
    rank_spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // tp)
    ranks = [_agent("decode", rank_spec, blocks, device, tp, r) for r in range(tp)]
    info = dataclasses.replace(ranks[0].handshake_info, ranks=tuple(a.handshake_info for a in ranks[1:]))
    sender = NixlKVSender(prefill)
    try:
        peer = sender.add_peer(info)
        _time_writes(sender, peer, blocks, 1)  # wire-up, and the bytes to check
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        heads = spec.num_kv_heads // tp
        matched = all(torch.equal(a.kv_cache.view(torch.uint8),
                                  prefill.kv_cache[..., r * heads:(r + 1) * heads, :].contiguous().view(torch.uint8))
                      for r, a in enumerate(ranks))
        seconds = _time_writes(sender, peer, blocks, iters)
    finally:
        sender.close()
        for agent in (prefill, *ranks):
            agent.close()
    median = statistics.median(seconds)
    rows = blocks * (1 if case == "whole" else 2 * spec.num_layers * spec.block_size * d)
    return {"case": case, "decode_tp": tp, "blocks": blocks, "descriptors": rows, "matched": matched,
            "median_ms": round(median * 1e3, 3), "gb_per_s": round(blocks * spec.bytes_per_block / 1e9 / median, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, DRAM, tiny shapes")
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    spec, device = (SMOKE_SPEC, "cpu") if args.smoke else (GPU_SPEC, "cuda:0")
    results = [run_case(case, spec, args.decode_tp, args.blocks, device, args.iters) for case in ("whole", "sliced")]
    for r in results:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu",
                       "date": time.strftime("%Y-%m-%d"), "results": results}, f, indent=2)
    return 0 if all(r["matched"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
