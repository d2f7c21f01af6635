"""The KV tier store alone under a 0%-hit pattern, on the CPU: engine-thread time per step and the disk
writer's backlog (engine/kv_tiers/store.py), no model.

    python -m lab.micro.bench_tier_store_zero_hit --steps 20

Default-model block shape (737,280 B), host tier 16 blocks, disk tier 512: every "step" frees 16 blocks
of unique content (offered to the store where it has `offer`) and evicts 16 (`demote`), then sleeps 50 ms
in place of the model (the I/O thread runs meanwhile). Works on any version of the store (measures the
old one when run from an older checkout). One intra-op thread: on an oversubscribed CI machine OpenMP's
spinning threads otherwise dominate every copy.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from engine.kv_tiers.store import TieredKVStore
from engine.kv_tiers.types import TierConfig

_PER_STEP = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kv = torch.randn(64, 30, 2, 16, 3, 64)
    bpb = kv[0].numel() * kv.element_size()
    with tempfile.TemporaryDirectory(prefix="baton-kv-") as tmp:
        store = TieredKVStore(TierConfig(16 * bpb, tmp, 512 * bpb, 0.0), kv, 16)
        offers = hasattr(store, "offer")
        between_steps = getattr(store, "between_steps", store.reap_writes)
        engine_ns = 0
        for step in range(args.steps):
            start = time.perf_counter_ns()
            between_steps()
            blocks = [((step * _PER_STEP + i) % kv.shape[0], 10**9 + step * _PER_STEP + i) for i in range(_PER_STEP)]
            for block_id, block_hash in blocks if offers else ():
                store.offer(block_id, block_hash)
            for block_id, block_hash in blocks:
                store.demote(block_id, block_hash)
            engine_ns += time.perf_counter_ns() - start
            time.sleep(0.05)
        start = time.perf_counter_ns()
        store.flush()
        backlog_ms = (time.perf_counter_ns() - start) / 1e6
        print(f"engine thread {engine_ns / 1e6 / args.steps:.2f} ms/step "
              f"({engine_ns / 1e3 / (args.steps * _PER_STEP):.0f} us/block); disk writer backlog at the end "
              f"{backlog_ms:.0f} ms; demoted {({t.value: n for t, n in store.snapshot().demoted_blocks.items()})}")
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
