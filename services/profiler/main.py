"""`baton profile`: time prefill and decode steps of one (model, hardware) pair, fit the scheduler's
cost model, and write one `WorkerProfile` JSON object for `baton scheduler --profile`.

    baton profile --quick                                    # default model, CPU, seconds
    baton profile --model /models/llama-8b --device cuda --dtype bfloat16 \\
        --attention-backend triton --num-blocks 20000 --max-num-seqs 128 \\
        --out llama-8b-h100.json --model-name llama-8b

The engine flags are `baton worker`'s own (same names, same defaults, same `EngineConfig`), so a
profile taken with a worker's flags runs that worker's code path: Triton kernels and CUDA graphs on
a GPU worker, the torch reference on CPU. Prompts are prefilled in one step each (no chunking).
BATON_CACHE_DIR (read here only) is where the default model is prepared.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.profiler.grid import build_grid

if TYPE_CHECKING:  # the engine (torch) is imported only when a profile runs
    from engine.llm_engine import LLMEngine


def register_profile_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `profile` to the `baton` CLI (services/cli.py)."""
    parser = subparsers.add_parser("profile", help="measure a worker's step times and write its cost profile",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_profile_args(parser)
    parser.set_defaults(func=run_profile_command)
    return parser


def add_profile_args(p: argparse.ArgumentParser) -> None:
    # The worker's engine flags, verbatim: a profile must run the engine the worker serves with.
    from services.worker.main import add_engine_args

    p.add_argument("--model", default="", help="HF dir or .gguf file (default: SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("--out", type=Path, default=Path("profile.json"), help="where to write the profile JSON")
    p.add_argument("--model-name", default=None,
                   help="write {NAME: profile} instead of a bare profile; NAME is the worker's --model-id")
    p.add_argument("--measurements-out", type=Path, default=None,
                   help="also write every timed point with its fitted time as JSON")
    p.add_argument("--quick", action="store_true", help="a small grid (prompts <= 256, batches <= 16): seconds")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per point (default 2; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds over the grid; a point's time is its median (default 5; 3 with --quick)")
    p.add_argument("--transfer-fixed-s", type=float, default=None,
                   help="KV transfer fixed cost, measured by lab/micro/bench_kv_transfer.py (default: "
                        "WorkerProfile's)")
    p.add_argument("--transfer-per-token-s", type=float, default=None,
                   help="KV transfer cost per token, from the same benchmark (default: WorkerProfile's)")


def run_profile_command(args: argparse.Namespace) -> int:
    from engine.errors import EngineError

    try:
        _check_args(args)
        profile_json, measurements = _profile(args)
        _write(args.out, profile_json)
        if args.measurements_out is not None:
            _write_measurements(args.measurements_out, measurements)
    except (ValueError, EngineError) as e:
        print(f"baton profile: error: {e}", file=sys.stderr)
        return 2
    print(f"\nwrote {args.out}: `baton scheduler --profile {args.out}`")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Fail before loading the model: a bad flag should not cost minutes of measuring first."""
    _check_device(args.device)
    _check_writable(args.out)
    if args.measurements_out is not None:
        _check_writable(args.measurements_out)
    if (args.warmup is not None and args.warmup < 0) or (args.repeats is not None and args.repeats < 1):
        raise ValueError("--warmup must be >= 0 and --repeats >= 1")
    for name in ("transfer_fixed_s", "transfer_per_token_s"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


def _check_device(device: str) -> None:
    import torch

    valid = "valid: cpu, cuda, cuda:N"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"unknown device {device!r}; {valid}") from e
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; {valid}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_writable(out: Path) -> None:
    if out.is_dir():
        raise ValueError(f"{out} is a directory; give a file path")
    if not out.parent.is_dir():
        why = "is not a directory" if out.parent.exists() else "does not exist"
        raise ValueError(f"cannot write {out}: {out.parent} {why}")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"cannot write {out}: permission denied")


def _profile(args: argparse.Namespace) -> tuple[str, dict]:
    """Load the engine, measure the grid, fit; print the report. Returns the profile file's text and
    the measurements (for `--measurements-out`)."""
    import torch

    from engine.llm_engine import LLMEngine
    from scheduler.calibration.profile_fit import build_profile, fit_measurements, outliers
    from services.profiler.measure import StepTimer, fill_kv_with_noise, measure_grid, remeasure
    from services.profiler.report import format_report, measurements_json

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    engine = LLMEngine(_engine_config(args))
    print(_banner(engine, args), flush=True)
    if engine.view.device.type == "cuda" and engine.config.attention_backend == "torch":
        print("note: the torch attention backend on CUDA runs every step eagerly; profile with the flags the "
              "worker serves with (GPU workers: --attention-backend triton)", file=sys.stderr)
    # The profile times the model runner's steps themselves, under the batcher: the one reader of the
    # engine's runner and block manager outside the engine (a worker reads `engine.view`).
    fill_kv_with_noise(engine.runner, engine.config.seed)
    timer = StepTimer(engine.runner, engine.block_manager, engine.model_config.vocab_size,
                      engine.view.device, seed=engine.config.seed)
    timing = _timing(args)
    grid = build_grid(engine.max_model_len, engine.config.batcher.max_num_seqs, args.quick)
    measured = measure_grid(timer, grid, timing, _progress)
    fits = fit_measurements(measured)
    suspects = outliers(measured, fits)
    if suspects:  # one more try for points a busy host slowed down, then refit
        _progress(f"timing {len(suspects)} point(s) far off the fit again")
        measured = remeasure(timer, measured, suspects, timing.repeats)
        fits = fit_measurements(measured)
    profile = build_profile(fits.prefill, fits.decode, args.transfer_fixed_s, args.transfer_per_token_s)
    print(format_report(measured, fits.prefill, fits.decode, profile))
    data: dict[str, Any] = dataclasses.asdict(profile)
    text = json.dumps({args.model_name: data} if args.model_name else data, indent=2, sort_keys=True) + "\n"
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return text, {"date": when, "banner": _banner(engine, args),
                  **measurements_json(measured, fits.prefill, fits.decode)}


def _engine_config(args: argparse.Namespace) -> Any:
    from services.worker.main import build_engine_config

    config = build_engine_config(args)
    return dataclasses.replace(config, cache_dir=os.environ.get("BATON_CACHE_DIR") or None)


def _timing(args: argparse.Namespace) -> Any:
    from services.profiler.measure import TimingConfig

    return TimingConfig(
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 2),
        repeats=args.repeats if args.repeats is not None else (3 if args.quick else 5),
    )


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _banner(engine: LLMEngine, args: argparse.Namespace) -> str:
    import torch

    cfg = engine.config
    device = engine.view.device
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, torch threads: {threads}"
    graphs = "CUDA graphs" if engine.view.cuda_graphs else "eager"
    return (f"profiling {cfg.model or 'the default model'} ({cfg.dtype}) on {where}: {cfg.attention_backend} "
            f"attention, {graphs}, {engine.view.kv_pool().total_blocks} KV blocks of {cfg.cache.block_size}, "
            f"max_model_len {engine.max_model_len}{', quick grid' if args.quick else ''}")


def _write(out: Path, text: str) -> None:
    """Write through a temporary file, then check the scheduler's own loader accepts the result."""
    from scheduler.adapters.profiles import ProfileBook

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(text)
        ProfileBook.load(tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)


def _write_measurements(out: Path, measurements: dict) -> None:
    try:
        out.write_text(json.dumps(measurements, indent=2) + "\n")
    except OSError as e:
        raise ValueError(f"cannot write {out}: {e}") from e
