"""NIXL KV WRITE between two processes on two GPUs (VRAM -> VRAM), against the torch P2P copy ceiling.

    python -m lab.micro.bench_kv_transfer --out kv_transfer.json          # 2 GPUs: cuda:0 -> cuda:1
    python -m lab.micro.bench_kv_transfer --smoke --out /tmp/kv.json      # CPU: DRAM, tiny shapes

Shape: Llama-3.1-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16, block 16): one block-major block
(engine/kv_cache.py) is 2 MiB, one descriptor. A 2k-token prompt is 128 blocks = 256 MiB.

Two spawned processes: the sender (A, cuda:0) holds a pool of random blocks, the receiver (B, cuda:1)
a zeroed pool of the same shape; each registers its pool with its own NixlAgent (VRAM on CUDA, DRAM
on CPU: the agent takes the memory type from the tensor's device), B's HandshakeInfo reaches A over a
multiprocessing Pipe, A's NixlKVSender WRITEs 128 blocks with the progress thread off (as the worker
runs it; B polls its agent all the while, as the worker's KV link thread does). Cases:
- contiguous: local 0..127 -> remote 0..127 (NIXL merges adjacent descriptors);
- random: 128 random distinct ids of the pool on each side, in random order (128 descriptors);
- contiguous+cksum: contiguous with the sender's per-block checksums (the worker's default;
  the receiver's verification is not included).
Time: sender.start() to the transfer turning DONE through sender.poll() (wall clock, spinning),
median of `--iters` after `--warmup`. Every case first zeroes B's pool, does one WRITE and checks the
destination blocks bit for bit (torch.equal on a byte view) against the source blocks.
Ceiling: `dst.copy_(src)` of the same bytes from cuda:0 to cuda:1 in the parent (median, both devices
synchronized); ratio = NIXL GB/s / ceiling GB/s (target >= 0.5 for the contiguous case).
Then (unless --no-isolated) a second pair in which each process sees only its own GPU
(CUDA_VISIBLE_DEVICES=<its GPU>, cuda:0), as bench_disagg_gpu runs its workers, repeats the contiguous
case: it shows whether UCX still uses cuda_ipc when the peer's GPU is masked out.
GB/s = bytes moved / 1e9 / seconds. Prints a table last; `--out` writes every number as JSON.
Exit code 0 only if every case ran and every destination matched its source.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.kv_cache import KVCacheSpec
from lab.micro.kv_transfer_procs import log, receiver_main, same_bytes, sender_main, sync

GPU_SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")  # 2 MiB
SMOKE_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 32 KiB
CASES = ("contiguous", "random", "contiguous+cksum")


# ---- parent -----------------------------------------------------------------------------------------
def copy_ceiling(src_dev: str, dst_dev: str, nbytes: int, iters: int, dtype: torch.dtype) -> list[float]:
    """Seconds of `dst.copy_(src)` of `nbytes` from src_dev to dst_dev (both synchronized), per iteration."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src = torch.randn(n, device=src_dev, dtype=dtype)
    dst = torch.empty(n, device=dst_dev, dtype=dtype)
    devs = {torch.device(d) for d in (src_dev, dst_dev)}

    def sync_all() -> None:
        for d in devs:
            sync(d)

    times = []
    for i in range(3 + iters):
        sync_all()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_all()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    ok = same_bytes(src.cpu(), dst.cpu()) if nbytes <= (1 << 30) else True
    del src, dst
    if any(d.type == "cuda" for d in devs):
        torch.cuda.empty_cache()
    if not ok:
        raise RuntimeError("copy ceiling: destination differs from source")
    return times


def environment(smoke: bool) -> dict:
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "smoke": smoke,
           "host": platform.node(), "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    try:
        from importlib.metadata import version

        import nixl  # noqa: F401

        env["nixl"] = version("nixl")
    except Exception as e:  # noqa: BLE001
        env["nixl"] = f"unknown ({e})"
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            env["p2p_0_1"] = torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None
        except Exception:  # noqa: BLE001
            env["p2p_0_1"] = None
    return env


def physical_gpu(device: str) -> str:
    """The CUDA_VISIBLE_DEVICES entry of `device` (cuda:N) as this process numbers it."""
    index = torch.device(device).index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def run_pair(args: argparse.Namespace, spec: KVCacheSpec, src_dev: str, dst_dev: str, case_names: tuple[str, ...],
             timeout_s: float, isolate: bool) -> tuple[dict | None, str]:
    """Spawn receiver + sender, run `case_names`; (results by case, error text). With `isolate` each child
    sees only its own GPU (CUDA_VISIBLE_DEVICES=<its GPU>, device cuda:0), as the workers run."""
    ctx = mp.get_context("spawn")
    a_end, b_end = ctx.Pipe()
    result_parent, result_child = ctx.Pipe(duplex=False)
    started = time.monotonic()
    child_src, child_dst = src_dev, dst_dev
    saved_cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    cvd = {}
    if isolate:
        cvd = {"src": physical_gpu(src_dev), "dst": physical_gpu(dst_dev)}
        child_src, child_dst = (d if d == "cpu" else "cuda:0" for d in (src_dev, dst_dev))  # cpu: smoke
    receiver = ctx.Process(target=receiver_main, name="recv", daemon=True,
                           args=(b_end, spec, args.pool_blocks, child_dst, timeout_s + 5))
    sender = ctx.Process(target=sender_main, name="send", daemon=True,
                         args=(a_end, result_child, spec, args.pool_blocks, child_src, args.blocks, args.warmup,
                               args.iters, args.seed, case_names))
    results: dict | None = None
    error = ""
    try:
        for proc, side in ((receiver, "dst"), (sender, "src")):
            if isolate:
                os.environ["CUDA_VISIBLE_DEVICES"] = cvd[side]  # a spawned child copies the environment at start
                log(f"{proc.name}: CUDA_VISIBLE_DEVICES={cvd[side]}, device cuda:0")
            proc.start()
    finally:
        if isolate:
            if saved_cvd is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved_cvd
    try:
        remaining = timeout_s - (time.monotonic() - started)
        while remaining > 0 and not result_parent.poll(min(1.0, remaining)):
            if not sender.is_alive() and not result_parent.poll(0):
                error = f"sender exited with {sender.exitcode} before reporting"
                break
            remaining = timeout_s - (time.monotonic() - started)
        if not error:
            if result_parent.poll(0):
                kind, payload = result_parent.recv()
                if kind == "results":
                    results = payload
                else:
                    error = f"sender failed:\n{payload}"
            else:
                error = f"no results within {timeout_s:.0f} s"
    finally:
        for proc in (sender, receiver):
            proc.join(15)
            if proc.is_alive():
                log(f"killing {proc.name} (pid {proc.pid})")
                proc.kill()
                proc.join(5)
    return results, error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, DRAM, tiny blocks: code paths only")
    p.add_argument("--blocks", type=int, default=128, help="blocks per WRITE (128 x 16 = 2k tokens)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each side's pool")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--src-device", default=None, help="default cuda:0 (cpu with --smoke)")
    p.add_argument("--dst-device", default=None, help="default cuda:1 (cpu with --smoke)")
    p.add_argument("--no-isolated", action="store_true",
                   help="skip the second pair whose processes each see only their own GPU (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--timeout-s", type=float, default=110.0, help="whole run; children are killed after it")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    started = time.monotonic()

    spec = SMOKE_SPEC if args.smoke else GPU_SPEC
    if args.smoke:
        src_dev, dst_dev = args.src_device or "cpu", args.dst_device or "cpu"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        n_gpus = torch.cuda.device_count()
        src_dev = args.src_device or "cuda:0"
        dst_dev = args.dst_device or ("cuda:1" if n_gpus > 1 else "cuda:0")
        if n_gpus < 2:
            log("WARNING: one GPU only: both processes use cuda:0 (not the NVLink case)")
    if args.pool_blocks < args.blocks:
        p.error("--pool-blocks must be >= --blocks")
    nbytes = args.blocks * spec.bytes_per_block
    env = environment(args.smoke)
    log(f"{env}")
    log(f"WRITE of {args.blocks} blocks x {spec.bytes_per_block / 2**20:.3f} MiB = {nbytes / 2**20:.1f} MiB, "
        f"{src_dev} -> {dst_dev}, pools of {args.pool_blocks} blocks")

    ceiling_times = copy_ceiling(src_dev, dst_dev, nbytes, args.iters, spec.torch_dtype)
    ceiling_s = statistics.median(ceiling_times)
    log(f"copy ceiling {src_dev}->{dst_dev}: median {ceiling_s * 1e3:.3f} ms = {nbytes / ceiling_s / 1e9:.1f} GB/s")

    # Main pair: both processes see every GPU. Then (GPU only, unless --no-isolated) a pair that sees
    # one GPU each, as bench_disagg_gpu runs its workers: does UCX still find cuda_ipc there?
    isolated_case = "contiguous [isolated]"
    budget = args.timeout_s - (time.monotonic() - started)
    with_isolated = not args.no_isolated and (args.smoke or (src_dev.startswith("cuda") and src_dev != dst_dev))
    results, error = run_pair(args, spec, src_dev, dst_dev, CASES, budget * (0.6 if with_isolated else 0.95),
                              isolate=False)
    results = results or {}
    errors = [f"main pair: {error}"] if error else []
    if with_isolated:
        budget = args.timeout_s - (time.monotonic() - started) - 5
        if budget < 20:
            errors.append(f"isolated pair skipped: {budget:.0f} s left")
        else:
            iso, iso_error = run_pair(args, spec, src_dev, dst_dev, (isolated_case,), budget, isolate=True)
            results.update(iso or {})
            if iso_error:
                errors.append(f"isolated pair: {iso_error}")

    report = {"environment": env, "spec": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
                                           "head_dim": spec.head_dim, "block_size": spec.block_size,
                                           "dtype": spec.dtype, "bytes_per_block": spec.bytes_per_block},
              "blocks": args.blocks, "bytes": nbytes, "src": src_dev, "dst": dst_dev,
              "ceiling": {"times_ms": [t * 1e3 for t in ceiling_times], "median_ms": ceiling_s * 1e3,
                          "gb_s": nbytes / ceiling_s / 1e9},
              "cases": {}, "errors": errors}
    rows = [("torch copy_ (ceiling)", ceiling_s, ceiling_times, True)]
    for name in (*CASES, isolated_case):
        if name in results:
            r = results[name]
            times = [t / 1e3 for t in r["times_ms"]]
            med = statistics.median(times)
            report["cases"][name] = {**r, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                                     "max_ms": max(times) * 1e3, "gb_s": nbytes / med / 1e9,
                                     "of_ceiling": ceiling_s / med}
            rows.append((name, med, times, r["verified"]))
    main_ok = all(name in report["cases"] for name in CASES)
    ok = main_ok and not errors and all(c["verified"] for c in report["cases"].values())
    report["ok"] = ok
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))

    print(f"\nNIXL KV WRITE {src_dev} -> {dst_dev}: {args.blocks} blocks x {spec.bytes_per_block} B = "
          f"{nbytes / 2**20:.1f} MiB, median of {args.iters} after {args.warmup} warm-up  ({env['date']})")
    if env.get("gpus"):
        print(f"GPUs: {env['gpus']}  p2p(0,1)={env.get('p2p_0_1')}  nixl {env.get('nixl')}")
    print(f"{'case':<24}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GB/s':>9}{'of ceiling':>12}{'verified':>10}")
    for name, med, times, verified in rows:
        print(f"{name:<24}{med * 1e3:>11.3f}{min(times) * 1e3:>9.3f}{max(times) * 1e3:>9.3f}"
              f"{nbytes / med / 1e9:>9.1f}{ceiling_s / med:>12.2f}{'yes' if verified else 'NO':>10}")
    for e in errors:
        print(f"ERROR: {e}")
    contiguous = report["cases"].get("contiguous")
    if contiguous:
        verdict = "meets" if contiguous["of_ceiling"] >= 0.5 else "MISSES"
        print(f"contiguous WRITE reaches {contiguous['of_ceiling']:.0%} of the copy ceiling ({verdict} target >= 50%)")
    iso_row = report["cases"].get(isolated_case)
    if iso_row:
        print(f"{isolated_case}: each process sees one GPU (as the disagg workers): {iso_row['gb_s']:.1f} GB/s"
              + ("  <- far below the shared-visibility case: cuda_ipc likely NOT used there"
                 if contiguous and iso_row["gb_s"] < 0.25 * contiguous["gb_s"] else ""))
    print("RESULT:", "OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
