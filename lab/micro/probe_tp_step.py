"""Where a tensor-parallel decode step spends its time: a one-off diagnostic, not a benchmark.

    python -m lab.micro.probe_tp_step --tp 2 [--eager] [--batch 32] [--ctx 1024]

Llama-3.1-8B shape, dummy bf16 weights, Triton attention. Times a whole `execute` on rank 0 and prints a
torch.profiler table of 5 steps (top ops by self CPU and by device time), so a slow TP step can be pinned
on the host (launches, the plan broadcast) or on the device.
Also runs a minimal NCCL all-reduce CUDA-graph capture + replay in its own 2-rank group first.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import ParallelConfig
from engine.parallel.group import open_rendezvous
from lab.micro.bench_decode import LLAMA31_8B, bench_engine_config, decode_plan, write_model_dir


def _capture_rank(rank: int, port: int, out: mp.Queue) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
    x = torch.ones(1024, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    x.fill_(1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        dist.all_reduce(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    out.put((rank, float(x[0])))  # 1 -> 2 -> 4 -> 8 after three replays of a 2-rank sum
    dist.destroy_process_group()


def minimal_capture(timeout_s: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rendezvous = open_rendezvous(ParallelConfig(tensor_parallel_size=2))  # open until the ranks are done
    procs = [ctx.Process(target=_capture_rank, args=(r, rendezvous.port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, value = out.get(timeout=timeout_s)
            got[rank] = value
    except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
        got["error"] = repr(e)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return got


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    print("minimal nccl capture (expect 8.0 on both ranks):", minimal_capture(60.0), flush=True)

    from engine.loader import load_model
    from engine.parallel.launcher import TensorParallelRunner

    model_dir = write_model_dir(LLAMA31_8B)
    blocks = args.batch * -(-args.ctx // 16) + 1
    config = bench_engine_config(model_dir, False, blocks, max_num_seqs=max(args.batch, 64), tp=args.tp,
                                 eager=args.eager)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    start = time.perf_counter()
    runner = TensorParallelRunner(config, loaded.model_config, loaded.weights)
    print(f"runner ready in {time.perf_counter() - start:.1f}s (eager={args.eager})", flush=True)
    try:
        runner.randomize_kv_cache(1)
        plan = decode_plan(args.batch, args.ctx, runner.num_blocks, seed=3)
        for _ in range(5):
            runner.execute(plan)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            runner.execute(plan)
        step_ms = (time.perf_counter() - t0) / 20 * 1e3
        print(json.dumps({"batch": args.batch, "ctx": args.ctx, "step_ms": step_ms}),
              flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.execute(plan)
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
        print(table.table(sort_by="self_device_time_total", row_limit=12), flush=True)
    finally:
        runner.shutdown()


if __name__ == "__main__":
    main()
