"""Decode step time of Llama-3.1-70B under tensor parallelism, against the per-GPU memory floor, plus
the NCCL all-reduce each layer pays.

    python -m lab.micro.bench_tp70b --out tp70b.json               # --tp 4 (default); 8 on 8 GPUs
    python -m lab.micro.bench_tp70b --smoke --out /tmp/tp.json     # CPU, gloo, tp 2: code paths only

Model: Llama-3.1-70B's shape (80 layers, hidden 8192, 64 query / 8 KV heads of 128, MLP 28672, vocab
128256, untied, llama3 rope scaling as bench_decode's 8B), dummy bf16 weights, Triton attention.
Decode replays CUDA graphs with the NCCL all-reduces captured inside (`--eager`: every kernel launched
from Python, the engine's behaviour before TP graphs worked), so both can be compared in one run.

Order of the run (one process per GPU at a time):
1. ceilings on cuda:0 (bench_decode.measure_ceilings): copy bandwidth (bytes read + written, 1 GiB)
   and bf16 matmul rate;
2. all-reduce microbenchmark: a separate spawn group of `tp` processes (NCCL, NVLS off, free port,
   the engine's own `init_tensor_parallel` / `TensorParallel.all_reduce`), one in-place all-reduce of
   a [batch, hidden] bf16 tensor per op, batches 1/32/128: median over repeats of (time of
   `--ar-iters` back-to-back ops) / `--ar-iters`, in microseconds, on rank 0. The group exits before
   the model loads;
3. the model over `tp` ranks (`TensorParallelRunner`: rank 0 here, the others spawned; each rank
   builds the dummy weights one full tensor at a time on its own GPU and keeps its slice), KV pool
   sized for batch 128 x context 1024 only, filled with random values; decode at batch 1/32/128 with
   every sequence at context 1024 (bench_decode.decode_plan: shuffled, non-contiguous blocks).

Per decode row (bench_decode.step_row):
- step_ms: wall time of `runner.execute(plan)` (plan broadcast, every rank's forward, sampling, the
  token read-back), median of `--iters` steps;
- floor_ms = (weights / tp + KV bytes read by one rank) / copy bandwidth of cuda:0; KV per rank is
  batch * ctx * layers * 2 * (kv_heads / tp) * head_dim * 2 B; of_floor = floor_ms / step_ms;
- ar_ms_per_step = 2 all-reduces per layer x layers x the microbenchmark's median at that batch, and
  ar_share = ar_ms_per_step / step_ms (isolated collectives: in the step they also wait for the
  slowest rank, so the share in the step can be larger). Not counted: the vocab-parallel embedding's
  all-reduce and the logits' all-gather (one each per step).
Memory: checked before anything loads: weights / tp + the KV pool + bench_decode.RESERVE_BYTES must fit
each card's total memory; the numbers are in the JSON ("memory"). Llama-70B (139 GB of bf16 weights)
at tp 4, per GPU: 34.75 GB (32.4 GiB) of weights + 10.7 GB (10.0 GiB) of KV pool (8193 blocks of 16
tokens, 80 KiB per token per rank: 2 of the 8 KV heads) + 6 GiB reserve = 48.4 GiB of ~79 GiB.

This measures the decode step of one TP group only. The disaggregated split (a TP prefill worker handing
KV rank by rank to a TP decode worker, against co-located TP workers) is lab/experiments/distserve.py
`--model-shape 70b --tp N` (lab/suites/tp70b_suite.sh runs both).

Prints a "row" line per result as it completes, a table last; writes every number to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import statistics
import time
import traceback

import torch
import torch.multiprocessing as mp

from engine.config import CacheConfig, ModelConfig, ParallelConfig
from engine.kv_cache import KVCacheSpec
from engine.parallel.group import init_tensor_parallel, local_kv_heads, open_rendezvous, shutdown_tensor_parallel
from lab.micro.bench_decode import (
    BLOCK,
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

LLAMA31_70B = dict(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=128)
ALLREDUCES_PER_LAYER = 2  # after o_proj and after down_proj (row-parallel partial sums)


# ------------------------------------------------------------------------------- all-reduce bench


def _allreduce_worker(rank: int, size: int, port: int, device_type: str, hidden: int, batches: list[int],
                      iters: int, reps: int, timeout_s: float, results: mp.Queue) -> None:
    """One rank of the all-reduce group; rank 0 puts {batch: median_us} (or an error string) on `results`."""
    try:
        config = ParallelConfig(tensor_parallel_size=size, timeout_s=timeout_s)
        tp = init_tensor_parallel(config, rank, port, device_type)
        try:
            cuda = device_type == "cuda"
            dtype = torch.bfloat16 if cuda else torch.float32
            out = {}
            for batch in batches:
                x = torch.randn(batch, hidden, dtype=dtype, device=tp.device)
                for _ in range(10):  # creates the communicator, warms the path
                    tp.all_reduce(x)
                    x.mul_(0.5)  # keep the values finite
                samples = []
                for _ in range(reps):
                    x.zero_()  # sums of zeros stay finite however many ops run
                    tp.barrier()
                    if cuda:
                        torch.cuda.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(iters):
                            tp.all_reduce(x)
                        end.record()
                        end.synchronize()
                        samples.append(start.elapsed_time(end) * 1e3 / iters)
                    else:
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            tp.all_reduce(x)
                        samples.append((time.perf_counter() - t0) * 1e6 / iters)
                out[batch] = statistics.median(samples)
            tp.barrier()
            if rank == 0:
                results.put(out)
        finally:
            shutdown_tensor_parallel()
    except BaseException:  # noqa: BLE001 - report any failure to the parent instead of hanging it
        results.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def bench_allreduce(tp: int, device_type: str, hidden: int, batches: list[int], iters: int, reps: int,
                    timeout_s: float) -> dict[int, float]:
    """Median microseconds of one [batch, hidden] all-reduce over `tp` spawned ranks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = open_rendezvous(ParallelConfig(tensor_parallel_size=tp, timeout_s=timeout_s))
    port = rendezvous.port  # the store stays open here until the ranks have met
    procs = [ctx.Process(target=_allreduce_worker, name=f"baton-ar{rank}", daemon=True,
                         args=(rank, tp, port, device_type, hidden, batches, iters, reps, timeout_s, results))
             for rank in range(tp)]
    try:
        for p in procs:
            p.start()
        try:
            got = results.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"all-reduce group gave no result in {timeout_s:.0f}s") from None
        if isinstance(got, str):
            raise RuntimeError(f"all-reduce worker failed:\n{got}")
        return got
    finally:
        for p in procs:
            p.join(30.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)


# ----------------------------------------------------------------------------------------- decode


def memory_plan(mc: ModelConfig, tp: int, batch: int, ctx: int, dtype: str) -> dict:
    """Per-GPU bytes: weights / tp, the KV pool for `batch` x `ctx`, the reserve; and the card's total."""
    spec = KVCacheSpec(mc.num_layers, local_kv_heads(mc.num_kv_heads, tp), mc.head_dim, BLOCK, dtype)
    num_blocks = batch * math.ceil(ctx / BLOCK) + 1
    weights = decode_bytes(mc, 0, 0, tp)[0]
    kv = num_blocks * spec.bytes_per_block
    total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    need = weights + kv + RESERVE_BYTES
    return {"num_blocks": num_blocks, "weights_gib": weights / 2**30, "kv_gib": kv / 2**30,
            "reserve_gib": RESERVE_BYTES / 2**30, "need_gib": need / 2**30,
            "card_gib": total / 2**30 if total else None, "fits": total is None or need <= total}


def run_decode(args: argparse.Namespace, model_dir: str, ceilings: dict, num_blocks: int,
               ar_us: dict[int, float]) -> tuple[list[dict], dict]:
    from engine.loader import load_model
    from engine.parallel.launcher import TensorParallelRunner

    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=max(args.batches), tp=args.tp,
                                 eager=args.eager)
    config = dataclasses.replace(config, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                                 parallel=dataclasses.replace(config.parallel, timeout_s=args.timeout))
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    t0 = time.perf_counter()
    runner = TensorParallelRunner(config, loaded.model_config, loaded.weights)
    loaded_info = {"load_s": time.perf_counter() - t0}
    rows = []
    try:
        if torch.cuda.is_available():
            loaded_info["rank0_allocated_gib"] = torch.cuda.memory_allocated(0) / 2**30
            loaded_info["rank0_free_gib"] = torch.cuda.mem_get_info(0)[0] / 2**30
        print("loaded", json.dumps(loaded_info), flush=True)
        runner.randomize_kv_cache(1)
        layers = runner.model_config.num_layers
        for batch in args.batches:
            row = step_row(runner, batch, args.context, args.tp, args.iters, ceilings, args.smoke)
            if batch in ar_us:
                row["ar_us"] = ar_us[batch]
                row["ar_ms_per_step"] = ALLREDUCES_PER_LAYER * layers * ar_us[batch] / 1e3
                row["ar_share"] = row["ar_ms_per_step"] / row["step_ms"]
                print("ar_share", json.dumps({"batch": batch, "ar_ms_per_step": row["ar_ms_per_step"],
                                         "ar_share": row["ar_share"]}), flush=True)
            rows.append(row)
    finally:
        runner.shutdown()
    return rows, loaded_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=None, help="ranks (default 4; 2 with --smoke)")
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 32 128; 1 4 with --smoke")
    parser.add_argument("--context", type=int, default=None, help="tokens per sequence (default 1024; 128 --smoke)")
    parser.add_argument("--iters", type=int, default=None, help="decode steps timed per case (default 20; 3 --smoke)")
    parser.add_argument("--ar-iters", type=int, default=100, help="back-to-back all-reduces per timed repeat")
    parser.add_argument("--ar-reps", type=int, default=20, help="timed repeats per all-reduce size")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective / group wait may take")
    parser.add_argument("--eager", action="store_true", help="no decode CUDA graphs (launch every kernel)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, gloo: checks the code, not the speed")
    args = parser.parse_args()
    args.tp = args.tp or (2 if args.smoke else 4)
    args.context = args.context or (128 if args.smoke else 1024)
    args.iters = args.iters or (3 if args.smoke else 20)
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 32, 128])
    if args.smoke:
        args.ar_iters, args.ar_reps = min(args.ar_iters, 10), min(args.ar_reps, 3)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by every spawned rank
    hf = SMOKE if args.smoke else LLAMA31_70B
    model_dir = write_model_dir(hf)
    mc = ModelConfig.from_hf_config(hf)
    env = environment()
    env.update(tp=args.tp, eager=args.eager, model="tiny (smoke)" if args.smoke else "Llama-3.1-70B shape, dummy bf16")
    columns = ["tp", "batch", "ctx", "step_ms", "floor_ms", "of_floor", "tok_s", "ar_us", "ar_us_per_layer",
               "ar_ms_per_step", "ar_share", "skipped"]

    gpus = torch.cuda.device_count() if not args.smoke else args.tp
    mem = memory_plan(mc, args.tp, max(args.batches), args.context, "float32" if args.smoke else "bfloat16")
    print("memory", json.dumps(mem), flush=True)
    if gpus < args.tp or not mem["fits"]:
        why = f"{gpus} GPU(s) visible" if gpus < args.tp else f"needs {mem['need_gib']:.1f} GiB per GPU"
        write_report(args.out, env, {"copy_gb_s": None, "matmul_tflop_s": None},
                     [{"tp": args.tp, "skipped": why}], columns)
        raise SystemExit(f"skipped: {why}")

    ceilings = measure_ceilings(not args.smoke)
    print("ceilings", json.dumps(ceilings), flush=True)

    ar_us = bench_allreduce(args.tp, "cpu" if args.smoke else "cuda", mc.hidden_size, args.batches,
                            args.ar_iters, args.ar_reps, args.timeout)
    ar_rows = []
    for batch in args.batches:
        r = {"kind": "all_reduce", "tp": args.tp, "batch": batch, "shape": [batch, mc.hidden_size],
             "dtype": "float32" if args.smoke else "bfloat16", "ar_us": ar_us[batch],
             "ar_us_per_layer": ALLREDUCES_PER_LAYER * ar_us[batch]}
        print("row", json.dumps(r), flush=True)
        ar_rows.append(r)

    rows, loaded_info = run_decode(args, model_dir, ceilings, mem["num_blocks"], ar_us)
    ceilings = dict(ceilings, memory=mem, load=loaded_info)
    write_report(args.out, env, ceilings, ar_rows + rows, columns)


if __name__ == "__main__":
    main()
