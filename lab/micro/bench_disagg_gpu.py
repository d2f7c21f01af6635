"""Disaggregated serving on 2 GPUs: token identity with a co-located worker, and the TTFT it adds.

    python -m lab.micro.bench_disagg_gpu --out disagg.json       # prefill GPU0, decode GPU1, both GPU0
    python -m lab.micro.bench_disagg_gpu --smoke --out /tmp/d.json  # CPU: tiny model, torch backend

Three real worker processes (`python -m services.worker`), dummy weights from one config.json and one
seed (identical weights in every worker), `--attention-backend triton --dtype bfloat16`:
- `both` on GPU0 (the co-located baseline), `prefill` on GPU0, `decode` on GPU1 with
  `--prefill-peers` = the prefill worker: KV goes GPU0 -> GPU1 over NIXL (UCX, VRAM).
  Prompts of >= --remote-threshold tokens prefill remotely, shorter ones on the decode worker.
Each worker sees only its own GPU (CUDA_VISIBLE_DEVICES=<n>, --device cuda:0; the engine has no
device guard, so --device cuda:1 with every GPU visible would run Triton on the wrong device);
`--gpu-visibility own-first` shows it every GPU with its own first (CUDA_VISIBLE_DEVICES=<n>,<others>),
`all` passes --device cuda:<n> without CUDA_VISIBLE_DEVICES.
Model (dummy, TinyLlama-like): hidden 2048, 16 layers, 16 heads / 8 KV heads of 128, MLP 5632,
vocab 32000, max_position 4096; KV 64 KiB per token.

(a) identity: 8 greedy requests (random token ids, 64..1500 tokens, max_tokens 32), one at a time,
    through the decode worker and through the both worker: the token ids must be equal, and the
    decode worker's prefill_path must be REMOTE for prompts >= the threshold, LOCAL below.
(b) TTFT at low load: 1k-token prompts (a new random prompt each time, so no prefix-cache hits),
    --ttft-warmup then --ttft-requests per path, one request at a time, paths alternating. TTFT =
    from calling Generate to the first response carrying tokens (client side, gRPC included).
    Reports p50 / p90 per path and the p50 difference (target: disagg adds <= 5 ms), and from the
    workers' Prometheus metrics over the TTFT phase: the prefill side's mean KV WRITE time and GB/s
    (64 MiB per 1k-token prompt), the decode side's mean hand-off time (reserve -> KV committed), and
    every hand-off phase's count / p50 / p90 / mean (`handoff_phases`, lab/experiments/handoff_phases.py).
    A WRITE far below NVLink speed means UCX did not use cuda_ipc (e.g. fell back to TCP).
Exit code: 0 only if every request succeeded, identity holds and the prefill paths are as expected.
Workers are stopped at the end and on any failure (SIGTERM, then SIGKILL); every wait has a timeout.
Worker logs go to --log-dir (default: a temp dir), printed in part on failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lab.experiments.handoff_phases import phase_summary, scrape
from lab.micro.disagg_workers import ROOT, DisaggWorkers, Worker, generate, gpu_count, log, physical_gpu
from rpcgen.baton.v1 import worker_pb2 as pb
from scheduler.types import WorkerRole
from services.launcher.fleet import WorkerPlan

GPU_MODEL = dict(architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
# Llama-3-8B's shape (dummy weights): 32 layers, 32 heads / 8 KV heads of 128, KV 128 KiB per token.
GPU_MODEL_8B = dict(GPU_MODEL, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
SMOKE_MODEL = dict(GPU_MODEL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
PATH_NAMES = {pb.PREFILL_PATH_UNSPECIFIED: "?", pb.PREFILL_PATH_REMOTE: "REMOTE", pb.PREFILL_PATH_LOCAL: "LOCAL",
              pb.PREFILL_PATH_LOCAL_FALLBACK: "LOCAL_FALLBACK"}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, torch backend, float32")
    p.add_argument("--prefill-gpu", type=int, default=0)
    p.add_argument("--decode-gpu", type=int, default=1)
    p.add_argument("--both-gpu", type=int, default=0)
    p.add_argument("--gpu-visibility", choices=["own", "own-first", "all"], default="own",
                   help="own: CUDA_VISIBLE_DEVICES=<n>; own-first: <n>,<others>; all: --device cuda:<n> (see above)")
    p.add_argument("--remote-threshold", type=int, default=256, help="--min-remote-prompt-tokens of the decode worker")
    p.add_argument("--kv-checksums", action=argparse.BooleanOptionalAction, default=None,
                   help="pass --(no-)kv-checksums to the workers (default: the worker's default)")
    p.add_argument("--shape", choices=["1b", "8b"], default="1b", help="dummy model shape on GPU (8b: Llama-3-8B)")
    p.add_argument("--kv-stream", choices=["on", "off"], default=None,
                   help="prefill worker: stream KV per chunk (on: from --kv-stream-min-prompt-tokens) or not")
    p.add_argument("--kv-stream-min-prompt-tokens", type=int, default=256)
    p.add_argument("--overlap-reserve", choices=["on", "off"], default=None,
                   help="decode worker: send the Prefill RPC before reserving (on) or after (off; no "
                        "PrefillDestination call reaches the prefill worker mid-prefill); default: the worker's")
    p.add_argument("--identity-requests", type=int, default=8)
    p.add_argument("--identity-max-tokens", type=int, default=32)
    p.add_argument("--ttft-prompt", type=int, default=1024)
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--ttft-warmup", type=int, default=3)
    p.add_argument("--target-added-ms", type=float, default=5.0, help="TTFT p50 disaggregation may add")
    p.add_argument("--ttft-max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="dummy-weight seed of every worker (and the prompts' seed)")
    p.add_argument("--both-seed", type=int, default=None,
                   help="negative control: another weight seed for the both worker must make identity FAIL")
    p.add_argument("--ready-timeout-s", type=float, default=150.0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--timeout-s", type=float, default=225.0, help="whole run (SIGALRM), workers stopped after")
    p.add_argument("--log-dir", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    def on_signal(signum: int, _frame: object) -> None:
        raise TimeoutError(f"signal {signum}: --timeout-s {args.timeout_s} passed or killed from outside")

    signal.signal(signal.SIGALRM, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.alarm(max(1, int(args.timeout_s)))

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-disagg-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-model-"))
    model_cfg = SMOKE_MODEL if args.smoke else GPU_MODEL_8B if args.shape == "8b" else GPU_MODEL
    (model_dir / "config.json").write_text(json.dumps(model_cfg))
    env_base = {"PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    common = ["--model", str(model_dir), "--load-format", "dummy", "--seed", str(args.seed),
              "--num-blocks", "1024" if not args.smoke else "512", "--max-num-seqs", "16",
              "--max-model-len", str(model_cfg["max_position_embeddings"]), "--drain-grace-s", "1",
              "--log-level", "INFO"]
    if args.kv_checksums is not None:
        common.append("--kv-checksums" if args.kv_checksums else "--no-kv-checksums")
    if args.kv_stream is not None:
        common += ["--kv-stream" if args.kv_stream == "on" else "--no-kv-stream",
                   "--kv-stream-min-prompt-tokens", str(args.kv_stream_min_prompt_tokens)]
    decode_only = [] if args.overlap_reserve is None else [
        "--overlap-reserve" if args.overlap_reserve == "on" else "--no-overlap-reserve"]
    n_gpus = 0 if args.smoke else gpu_count()
    if not args.smoke and n_gpus == 0:
        print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
        return 2
    if not args.smoke and n_gpus < 2 and args.decode_gpu >= n_gpus:
        log(f"WARNING: {n_gpus} GPU: the decode worker moves to GPU0")
        args.decode_gpu = 0

    def placement(gpu: int) -> tuple[list[str], dict[str, str]]:
        if args.smoke:
            return (["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--torch-threads", "1"],
                    {**env_base, "OMP_NUM_THREADS": "1"})
        engine = ["--dtype", "bfloat16", "--attention-backend", "triton"]
        if args.gpu_visibility == "all":
            return [*engine, "--device", f"cuda:{gpu}"], dict(env_base)
        visible = [physical_gpu(gpu)]
        if args.gpu_visibility == "own-first":
            visible += [physical_gpu(i) for i in range(n_gpus) if i != gpu]
        return [*engine, "--device", "cuda:0"], {**env_base, "CUDA_VISIBLE_DEVICES": ",".join(visible)}

    report: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "smoke": args.smoke, "python": platform.python_version(), "model": model_cfg,
                    "placement": {"prefill": args.prefill_gpu, "decode": args.decode_gpu, "both": args.both_gpu},
                    "remote_threshold": args.remote_threshold, "kv_stream": args.kv_stream,
                    "overlap_reserve": args.overlap_reserve,
                    "log_dir": str(log_dir), "errors": []}
    pre_args, pre_env = placement(args.prefill_gpu)
    both_args, both_env = placement(args.both_gpu)
    if args.both_seed is not None:
        both_args += ["--seed", str(args.both_seed)]  # argparse: the last --seed wins
    dec_args, dec_env = placement(args.decode_gpu)
    # Stopped in reverse: decode first, as it holds the prefill worker as a KV peer.
    fleet = DisaggWorkers([
        WorkerPlan("prefill-0", WorkerRole.PREFILL, (*common, *pre_args), pre_env, worker_id=True),
        WorkerPlan("both-0", WorkerRole.BOTH, (*common, *both_args), both_env, worker_id=True),
        WorkerPlan("decode-0", WorkerRole.DECODE, (*common, *dec_args, "--min-remote-prompt-tokens",
                                                   str(args.remote_threshold), "--min-remote-uncached-tokens", "32",
                                                   *decode_only),
                   dec_env, prefill_peers=("prefill-0",), worker_id=True)], log_dir, args.ready_timeout_s)
    rc = 1
    try:
        t0 = time.monotonic()
        with fleet as workers:
            report["startup_s"] = time.monotonic() - t0
            log(f"all 3 workers ready after {report['startup_s']:.1f} s (logs in {log_dir})")
            rc = run_checks(args, model_cfg, workers["prefill-0"], workers["decode-0"], workers["both-0"], report)
            log("stopping workers")
    except BaseException as e:  # noqa: BLE001 - report (the workers are stopped by then)
        report["errors"].append(f"{type(e).__name__}: {e}")
        log(f"FAILED: {type(e).__name__}: {e}")
        print(fleet.log_tails(25), flush=True)
        rc = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log("workers stopped")
        shutil.rmtree(model_dir, ignore_errors=True)
    report["ok"] = rc == 0
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print_tables(report, args)
    return rc


def scrape_phases(*workers: Worker) -> dict[str, dict[str, float]]:
    """Each worker's hand-off phase histograms ({} for one that cannot be scraped: diagnostics only)."""
    out: dict[str, dict[str, float]] = {}
    for w in workers:
        try:
            out[w.name] = scrape(w.metrics_url)
        except OSError as e:
            log(f"hand-off phases of {w.name} unavailable: {e}")
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def kv_stats(prefill_delta: dict[str, float], decode_delta: dict[str, float]) -> dict:
    n = prefill_delta.get("baton_kv_transfer_seconds_count", 0.0)
    secs = prefill_delta.get("baton_kv_transfer_seconds_sum", 0.0)
    nbytes = prefill_delta.get("baton_kv_transfer_bytes_total", 0.0)
    handoffs = decode_delta.get("baton_pd_handoff_seconds_count", 0.0)
    return {"writes": int(n), "bytes": int(nbytes),
            "write_mean_ms": secs / n * 1e3 if n else None,
            "write_gb_s": nbytes / secs / 1e9 if secs > 0 else None,
            "handoffs": int(handoffs),
            "handoff_mean_ms": decode_delta.get("baton_pd_handoff_seconds_sum", 0.0) / handoffs * 1e3
            if handoffs else None}


def run_checks(args: argparse.Namespace, model_cfg: dict, prefill: Worker, decode: Worker, both: Worker,
               report: dict) -> int:
    rng = random.Random(args.seed)
    vocab = model_cfg["vocab_size"]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    timeout = args.request_timeout_s
    failures: list[str] = report["errors"]

    # Warm-up: JIT-compiles the kernels and wires up gRPC + NIXL on both paths (local and remote).
    t0 = time.monotonic()
    for n in (80, args.remote_threshold + 50, 1500, args.ttft_prompt):
        for w in (decode, both):
            r = generate(w, prompt(n), 8, max(timeout, 120.0))
            if r["error"]:
                raise RuntimeError(f"warm-up on {w.name} ({n} tokens) failed: {r['error']}")
    report["warmup_s"] = time.monotonic() - t0
    log(f"warm-up done in {report['warmup_s']:.1f} s")

    # (a) identity
    lengths = [64, 1500] + [rng.randint(65, 1499) for _ in range(max(0, args.identity_requests - 2))]
    lengths = lengths[: args.identity_requests]
    rng.shuffle(lengths)
    identity = []
    for i, n in enumerate(lengths):
        pr = prompt(n)
        d = generate(decode, pr, args.identity_max_tokens, timeout)
        b = generate(both, pr, args.identity_max_tokens, timeout)
        want_path = pb.PREFILL_PATH_REMOTE if n >= args.remote_threshold else pb.PREFILL_PATH_LOCAL
        first_diff = next((j for j, (x, y) in enumerate(zip(d["tokens"], b["tokens"], strict=False)) if x != y),
                          None if len(d["tokens"]) == len(b["tokens"]) else min(len(d["tokens"]), len(b["tokens"])))
        row = {"prompt_tokens": n, "path": PATH_NAMES.get(d["path"], str(d["path"])),
               "expected_path": PATH_NAMES[want_path], "fallback_reason": d["fallback_reason"],
               "both_path": PATH_NAMES.get(b["path"], str(b["path"])),
               "identical": not d["error"] and not b["error"] and d["tokens"] == b["tokens"],
               "first_mismatch": first_diff, "decode_error": d["error"], "both_error": b["error"],
               "decode_tokens": d["tokens"], "both_tokens": b["tokens"]}
        identity.append(row)
        status = "same" if row["identical"] else f"MISMATCH at token {first_diff}"
        log(f"identity {i}: {n:>5} tokens  path {row['path']:<6} (want {row['expected_path']})  {status}"
            + (f"  errors: {d['error']!r} / {b['error']!r}" if d["error"] or b["error"] else ""))
        if not row["identical"]:
            failures.append(f"identity {i} ({n} tokens): {status}; decode {d['tokens'][:12]}... "
                            f"both {b['tokens'][:12]}..."
                            + (f" errors {d['error']!r} / {b['error']!r}" if d["error"] or b["error"] else ""))
        if d["path"] != want_path:
            failures.append(f"identity {i} ({n} tokens): prefill_path {row['path']}, expected {row['expected_path']}"
                            + (f" (fallback: {d['fallback_reason']})" if d["fallback_reason"] else ""))
    report["identity"] = identity
    distinct = {t for r in identity for t in r["decode_tokens"]}
    report["identity_distinct_tokens"] = len(distinct)
    if len(distinct) <= 2:
        log(f"WARNING: the outputs use {len(distinct)} distinct token ids: degenerate dummy model, "
            "identity is a weak check here")

    # (b) TTFT at low load: one request at a time, paths alternating, a fresh prompt each time.
    ttft: dict[str, list[float]] = {"disagg": [], "both": []}
    paths_seen: list[str] = []
    metrics_before: tuple[dict, dict] = ({}, {})
    phases_before: dict[str, dict[str, float]] = {}
    # Each pair's own difference too: the two paths alternate, so a slow stretch of the GPU or host
    # shifts both requests of a pair, and the median of the differences is steadier than the medians' gap.
    pair_added: list[float] = []
    for i in range(args.ttft_warmup + args.ttft_requests):
        if i == args.ttft_warmup:
            metrics_before = (prefill.metrics(), decode.metrics())
            phases_before = scrape_phases(prefill, decode)
        pair: dict[str, float] = {}
        for key, w in (("disagg", decode), ("both", both)):
            r = generate(w, prompt(args.ttft_prompt), args.ttft_max_tokens, timeout)
            if r["error"] or r["ttft_s"] is None:
                failures.append(f"ttft {key} #{i}: {r['error'] or 'no token'}")
                continue
            if i >= args.ttft_warmup:
                ttft[key].append(r["ttft_s"])
                pair[key] = r["ttft_s"]
                if key == "disagg":
                    paths_seen.append(PATH_NAMES.get(r["path"], str(r["path"])))
        if len(pair) == 2:
            pair_added.append(pair["disagg"] - pair["both"])
    if any(p != "REMOTE" for p in paths_seen):
        failures.append(f"ttft: disagg requests took paths {sorted(set(paths_seen))}, expected REMOTE only")
    report["ttft"] = {k: {"times_ms": [t * 1e3 for t in v],
                          "p50_ms": percentile(v, 0.5) * 1e3 if v else None,
                          "p90_ms": percentile(v, 0.9) * 1e3 if v else None,
                          "mean_ms": statistics.fmean(v) * 1e3 if v else None} for k, v in ttft.items()}
    report["ttft"]["disagg_paths"] = sorted(set(paths_seen))
    report["kv_during_ttft"] = kv_stats(metric_delta(metrics_before[0], prefill.metrics()),
                                        metric_delta(metrics_before[1], decode.metrics()))
    report["handoff_phases"] = phase_summary(phases_before, scrape_phases(prefill, decode))
    if ttft["disagg"] and ttft["both"]:
        report["ttft"]["p50_added_ms"] = report["ttft"]["disagg"]["p50_ms"] - report["ttft"]["both"]["p50_ms"]
    if pair_added:
        report["ttft"]["pairs_p50_added_ms"] = percentile(pair_added, 0.5) * 1e3
    return 0 if not failures else 1


def print_tables(report: dict, args: argparse.Namespace) -> None:
    where = "CPU smoke" if report["smoke"] else (f"prefill GPU{args.prefill_gpu} -> decode GPU{args.decode_gpu} "
                                                 f"(NIXL VRAM), both GPU{args.both_gpu}")
    print(f"\nDisaggregated serving, {where}, KV streaming {report.get('kv_stream') or 'default'}, overlapped "
          f"reserve {report.get('overlap_reserve') or 'default'}  ({report['date']})")
    ident = report.get("identity", [])
    if ident:
        print(f"\n(a) identity: {len(ident)} greedy requests, decode worker vs both worker "
              f"(remote at >= {report['remote_threshold']} tokens)")
        print(f"{'#':>3}{'prompt':>8}  {'path':<15}{'expected':<10}{'tokens':>7}  result")
        for i, r in enumerate(ident):
            res = "identical" if r["identical"] else f"MISMATCH at {r['first_mismatch']}"
            if r["decode_error"] or r["both_error"]:
                res += f" (errors: {r['decode_error']!r} / {r['both_error']!r})"
            print(f"{i:>3}{r['prompt_tokens']:>8}  {r['path']:<15}{r['expected_path']:<10}"
                  f"{len(r['decode_tokens']):>7}  {res}")
        n_same = sum(r["identical"] for r in ident)
        n_path = sum(r["path"] == r["expected_path"] for r in ident)
        print(f"identical: {n_same}/{len(ident)}   expected prefill path: {n_path}/{len(ident)}   "
              f"distinct output token ids: {report.get('identity_distinct_tokens')}")
    t = report.get("ttft")
    if t:
        print(f"\n(b) TTFT, {args.ttft_prompt}-token prompts, one at a time, {len(t['both']['times_ms'])} per path "
              f"after {args.ttft_warmup} warm-up")
        print(f"{'path':<22}{'p50 ms':>9}{'p90 ms':>9}{'mean ms':>9}{'n':>4}")
        for key, label in (("both", "both (co-located)"), ("disagg", "disagg (remote)")):
            v = t[key]
            if v["p50_ms"] is None:
                print(f"{label:<22}{'-':>9}{'-':>9}{'-':>9}{0:>4}")
            else:
                print(f"{label:<22}{v['p50_ms']:>9.2f}{v['p90_ms']:>9.2f}{v['mean_ms']:>9.2f}{len(v['times_ms']):>4}")
        if "p50_added_ms" in t:
            added = t["p50_added_ms"]
            verdict = "meets" if added <= args.target_added_ms else "MISSES"
            print(f"p50 added by disaggregation: {added:+.2f} ms ({verdict} target <= {args.target_added_ms:g} ms)"
                  f"; disagg paths seen: {t['disagg_paths']}")
        if "pairs_p50_added_ms" in t:
            print(f"p50 of each pair's difference (disagg - both, back to back): {t['pairs_p50_added_ms']:+.2f} ms")
    kv = report.get("kv_during_ttft")
    if kv and kv["writes"]:
        print(f"KV hand-off during the measured TTFT requests (worker metrics): {kv['writes']} WRITEs of "
              f"{kv['bytes'] / max(kv['writes'], 1) / 2**20:.1f} MiB, mean {kv['write_mean_ms']:.2f} ms = "
              f"{kv['write_gb_s']:.1f} GB/s (prefill side, checksums included if on); decode hand-off "
              f"(reserve -> committed) mean {kv['handoff_mean_ms'] or 0:.2f} ms over {kv['handoffs']}")
    elif kv is not None:
        print("KV hand-off metrics: none scraped")
    for worker, phases in sorted((report.get("handoff_phases") or {}).items()):
        for phase, v in sorted(phases.items()):
            print(f"hand-off phase {worker:>10} {phase:<17} n={v['count']:<4} p50 {v['p50_ms']} ms  "
                  f"p90 {v['p90_ms']} ms  mean {v['mean_ms']} ms")
    if report.get("startup_s") is not None:
        print(f"\nstartup {report['startup_s']:.1f} s, warm-up {report.get('warmup_s', 0):.1f} s, "
              f"logs: {report['log_dir']}")
    for e in report["errors"]:
        print(f"ERROR: {e}")
    print("RESULT:", "OK" if report["ok"] else "FAIL")


if __name__ == "__main__":
    sys.exit(main())
