"""What one DistServe run does: per-model defaults, the cluster and workloads a run builds from its
arguments, and whether the GPUs can hold it (lab/experiments/distserve.py runs the plan)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lab.experiments import distserve_assets as assets
from lab.experiments.distserve_cluster import DistServeSpec


@dataclass(frozen=True)
class Workload:
    name: str
    args: tuple[str, ...]  # dataset flags of `baton bench`
    rates: tuple[float, ...]
    drain_s: float  # expected tail after the last arrival (for the time plan)


@dataclass(frozen=True)
class Profile:
    """Defaults of one model (flags override rates, SLOs and duration)."""
    random_len: tuple[int, int]  # ISL, OSL
    random_rates: tuple[float, ...]
    sharegpt_rates: tuple[float, ...]
    slo_ms: tuple[float, float]  # TTFT, TPOT
    duration_s: float
    drain_s: tuple[float, float]  # random, sharegpt
    request_timeout_s: float
    startup_s: float  # guess: worker start (weights, graphs) + warm-up, for the logged time plan
    sharegpt_output_len: int | None = None  # None: the conversations' own answers (<= 512 tokens)


PROFILES = {
    "8b": Profile((2048, 128), (4, 8, 12, 16), (5, 10, 20), (500, 50), 10, (6, 10), 30, 90),
    # 512-token answers at a ~40 ms step: a ShareGPT tail of ~20 s; the timeout allows a 100 ms TPOT.
    "70b": Profile((2048, 128), (1, 2, 3, 4), (2, 4, 8), (1500, 100), 6, (8, 16), 60, 90),
    # 320 prompt tokens: above the scheduler's 256-token threshold, so `disagg` prefills remotely.
    "smoke": Profile((320, 8), (0.5, 1.0), (0.5,), (5000, 1000), 4, (3, 6), 60, 30, sharegpt_output_len=8),
}
KV_GIB_PER_RANK = 40
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Plan:
    spec: DistServeSpec
    workloads: tuple[Workload, ...]
    duration_s: float
    request_timeout_s: float
    warmup: tuple[tuple[str, ...], ...]  # bench dataset flags, run once per configuration, not reported


GPU_ENGINE = ("--dtype", "bfloat16", "--attention-backend", "triton", "--load-format",
              "dummy", "--seed", "0", "--max-num-seqs", "128", "--no-prefix-caching", "--log-level", "INFO")
SMOKE_ENGINE = ("--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--torch-threads", "1",
                "--max-num-seqs", "8", "--max-model-len", "2048", "--no-prefix-caching", "--log-level", "INFO")
NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def kv_bytes_per_block(hf: dict, tp: int) -> int:
    """One block's K and V, all layers, on one rank (bf16; KV heads split over ranks, at least 1 each)."""
    return hf["num_hidden_layers"] * 2 * max(1, hf["num_key_value_heads"] // tp) * hf["head_dim"] * 2 * BLOCK_TOKENS


def weight_bytes(hf: dict) -> int:
    """bf16 parameters of a Llama config (embedding + LM head + layers)."""
    h, hd = hf["hidden_size"], hf["head_dim"]
    attn = h * hd * (2 * hf["num_attention_heads"] + 2 * hf["num_key_value_heads"])
    layer = attn + 3 * h * hf["intermediate_size"] + 2 * h
    return 2 * (2 * hf["vocab_size"] * h + hf["num_hidden_layers"] * layer + h)


def make_plan(work: Path, args: argparse.Namespace) -> Plan:
    prof = PROFILES["smoke" if args.smoke else args.model_shape]
    isl, osl = args.random_len or prof.random_len
    sharegpt = assets.unpack_sharegpt(work / "sharegpt-subset.json")
    # The KV pool, then any worker flags under test (`--worker-args`): last, so they win.
    worker_tail = ("--num-blocks", str(args.num_blocks), *shlex.split(args.worker_args))
    if args.smoke:
        from engine.loader import default_model_dir

        model_dir = default_model_dir(None)
        spec = DistServeSpec(model_dir, model_dir.name, (*SMOKE_ENGINE, *worker_tail), args.slo_ttft_ms,
                             args.slo_tpot_ms, args.policy, args.scheduler_profile, args.gateway_processes, cpu=True,
                             env={"OMP_NUM_THREADS": "1"}, tap_scheduler=args.tap_scheduler)
        warmup: tuple[tuple[str, ...], ...] = (
            ("--dataset", "random", "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "2"),)
    else:
        name, hf = assets.SHAPES[args.model_shape]
        model_dir = assets.build_model_dir(work / name, hf)
        # The worker sees its GPUs only; under TP the engine wants "cuda" (rank r takes cuda:r).
        device = ("--device", "cuda:0" if args.tp == 1 else "cuda")
        context = ("--max-model-len", str(max(4096, isl + osl + 64)))
        spec = DistServeSpec(model_dir, name, (*device, *GPU_ENGINE, *context, *worker_tail), args.slo_ttft_ms,
                             args.slo_tpot_ms, args.policy, args.scheduler_profile, args.gateway_processes, tp=args.tp,
                             env=NO_NVLS, tap_scheduler=args.tap_scheduler)
        # The measured prompt length too: a shape first seen while serving compiles then (~1 s TTFT).
        warmup = (("--dataset", "random", "--random-input-len", str(isl), "--random-output-len", "16",
                   "--num-prompts", "12", "--request-rate", "6"),
                  ("--dataset", "random", "--random-input-len", "2048", "--random-output-len", "16",
                   "--num-prompts", "12", "--request-rate", "6"),
                  ("--dataset", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", "12",
                   "--request-rate", "6", "--sharegpt-output-len", "16"))
    random = ("--dataset", "random", "--random-input-len", str(isl), "--random-output-len", str(osl))
    share: tuple[str, ...] = ("--dataset", "sharegpt", "--dataset-path", str(sharegpt))
    if prof.sharegpt_output_len:
        share += ("--sharegpt-output-len", str(prof.sharegpt_output_len))
    workloads = (Workload("random", random, tuple(args.random_rates), prof.drain_s[0]),
                 Workload("sharegpt", share, tuple(args.sharegpt_rates), prof.drain_s[1]))
    # `--sharegpt-rates` (or `--random-rates`) given with no value leaves that workload out.
    return Plan(spec, tuple(w for w in workloads if w.rates), args.duration_s, prof.request_timeout_s, warmup)


def gpu_memory_mib() -> list[int] | None:
    """Every GPU's total memory by physical index (the workers' CUDA_VISIBLE_DEVICES), from nvidia-smi so
    that this process opens no CUDA context; None where nvidia-smi is missing or says something else."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [int(line) for line in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check_gpus(args: argparse.Namespace, record: dict) -> str | None:
    """Why the GPUs cannot hold this run (too few; weights / tp + KV pool over a card), or None."""
    hf = assets.SHAPES[args.model_shape][1]
    weights, kv_pool = weight_bytes(hf) / args.tp, args.num_blocks * kv_bytes_per_block(hf, args.tp)
    need = weights + kv_pool
    record["memory_per_rank_gib"] = {"weights": round(weights / 2**30, 1), "kv_pool": round(kv_pool / 2**30, 1)}
    gpus = gpu_memory_mib()
    if gpus is None:
        return None
    needed = max(layout.gpus(args.tp) for layout in args.layouts)
    if len(gpus) < needed:
        return f"needs {needed} GPUs (the largest layout's workers x --tp {args.tp}), {len(gpus)} visible"
    if need > min(gpus) * 2**20:
        return (f"weights / tp + KV pool = {need / 2**30:.1f} GiB per rank > {min(gpus) / 1024:.1f} GiB per card "
                f"(lower --num-blocks, raise --tp or use larger cards)")
    return None
