"""Checksum and disk-file throughput of one KV block on the CPU: what the disk tier's I/O thread pays
per block it writes or reads (engine/kv_tiers/disk_files.py).

    python -m lab.micro.bench_block_file_checksum            # 2 MiB (8B bf16) and 720 KiB (default model) blocks

Compares engine/kv_integrity.py's `block_checksums` on the CPU (the hand-off's checksum, whose torch
reference the disk files used until 2026-12-02) with the CRC-32 of the raw bytes the files use now, and
times a whole file write + verified read in a temporary directory (page cache: the disk's own speed is
not measured).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

from engine.kv_integrity import block_checksums
from engine.kv_tiers.disk_files import DiskBlockFiles, raw_bytes

BLOCKS = {"llama8b_bf16_2MiB": ((32, 2, 16, 8, 128), torch.bfloat16),
          "smollm2_f32_720KiB": ((30, 2, 16, 3, 64), torch.float32)}


def _rate(nbytes: int, fn: Callable[[], object], min_s: float) -> float:
    """Bytes/s of `fn` repeated for at least `min_s` seconds (at least twice)."""
    fn()
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < min_s:
        fn()
        runs += 1
    return nbytes * runs / (time.perf_counter() - start)


def measure(shape: tuple[int, ...], dtype: torch.dtype, min_s: float) -> dict[str, float]:
    block = torch.randn(1, *shape).to(dtype)
    nbytes = block.numel() * block.element_size()
    out = torch.empty_like(block)
    with tempfile.TemporaryDirectory(prefix="baton-kv-bench-") as tmp:
        files = DiskBlockFiles(tmp)

        def round_trip() -> None:
            files.write(1, block[0])
            files.read_into(1, out[0])

        return {"block_bytes": nbytes,
                "kv_integrity_cpu_bytes_per_s": _rate(nbytes, lambda: block_checksums(block, [0]), min_s),
                "crc32_bytes_per_s": _rate(nbytes, lambda: zlib.crc32(raw_bytes(block[0])), min_s),
                "file_write_read_bytes_per_s": _rate(2 * nbytes, round_trip, min_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-s", type=float, default=2.0, help="time per measurement")
    args = ap.parse_args()
    results = {name: measure(shape, dtype, args.min_s) for name, (shape, dtype) in BLOCKS.items()}
    for name, r in results.items():
        print(f"{name}: kv_integrity (CPU) {r['kv_integrity_cpu_bytes_per_s'] / 1e6:8.1f} MB/s   "
              f"crc32 {r['crc32_bytes_per_s'] / 1e6:8.1f} MB/s   "
              f"file write+read {r['file_write_read_bytes_per_s'] / 1e6:8.1f} MB/s")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
