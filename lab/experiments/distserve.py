"""DistServe: cluster layouts compared by goodput vs rate — by default 1 prefill + 1 decode worker vs 2
co-located `both` workers; `--configs c4 1p3d 2p2d 3p1d` compares the 4-GPU layouts (any c<N> / <X>p<Y>d,
lab/experiments/layouts.py). Each worker on `--tp` GPUs.

    python -m lab.experiments.distserve_assets                 # here, once: .data/distserve/ (carried)
    bash lab/suites/distserve_suite.sh                          # on the 2-GPU box (OUT=... for the output)
    bash lab/suites/distserve_suite.sh --configs c4 1p3d ...    # on the 4-GPU box (layouts.py)
    OUT=... bash lab/suites/tp70b_suite.sh                      # 4 GPUs: --model-shape 70b --tp 2 (H200)
    .venv/bin/python -m lab.experiments.distserve --smoke --out /tmp/distserve-smoke   # CPU, tiny
    .venv/bin/python -m lab.experiments.distserve --replot OUT  # summary + plots again from OUT/results.tar.gz

The real stack end to end: `baton bench` (in this process; OpenAI HTTP streaming client) -> gateway
(`BATON_AUTH_MODE=none`: no Postgres/Redis/Kafka) -> scheduler service (policy `least_loaded`: no
learnt cost model to warm up and no SLO-based shedding, so the comparison is of the two
architectures, not of admission control) -> workers. Configurations, one at a time, same SLOs:
- `disagg`: prefill worker on GPUs [0, tp), decode worker on [tp, 2 tp) (`--prefill-peers`; KV over
  NIXL, rank by rank between TP workers). The scheduler sends prompts with >= 256 uncached tokens to
  the prefill worker; shorter ones (a part of ShareGPT) prefill on the decode worker (conditional
  disaggregation, the scheduler's default rule);
- `colocated`: one `both` worker per GPU group ([0, tp) and [tp, 2 tp)); the scheduler balances by load.
A worker sees its GPUs only (CUDA_VISIBLE_DEVICES=its GPUs, `--tensor-parallel-size tp`, `--device cuda:0`;
under TP `--device cuda`, the engine's rule: rank r takes cuda:r).
Model (`--model-shape`): 8b = Llama-3.1-8B's shape (hidden 4096, 32 layers, 32/8 heads, MLP 14336), 70b =
Llama-3.1-70B's (hidden 8192, 80 layers, 64/8 heads, MLP 28672; 70.5 GB of weights per rank at TP=2);
both vocab 128256, head 128, llama3 RoPE; dummy bf16 weights (one seed), Triton attention, CUDA graphs;
every worker: 128 sequences, a KV pool of 40 GiB per rank (--num-blocks: 8b TP=1 20480 blocks of 16
tokens = 2 MiB each; 70b TP=2 16384 of 2.5 MiB: 80 layers x K,V x 4 KV heads x 128 x 2 B x 16), the
engine's default 2048-token step budget with 512-token prefill chunks, prefix caching OFF (the sweep
reuses prompts across rates; DistServe has none either). Before starting, the GPU count (>= 2 tp) and
weights / tp + KV pool per card are checked (nvidia-smi): 70b at TP=2 needs H200s (~106 GiB per rank).

Workloads (each rate: Poisson arrivals for --duration-s seconds, its own seed, the same prompts and
arrival times for both configurations; `ignore_eos`, greedy):
Each rate sends ceil(rate x duration) requests (none after 1.5 x duration: `--max-duration`).
8b (TP=1):
- `random`: ISL 2048 / OSL 128 exactly, rates 4 8 12 16 req/s. Why: a 2k-token prefill of this model
  takes ~65-90 ms on one H100/H200 (31.5k tok/s measured, docs/benchmarks.md), so one prefill GPU
  saturates at ~11-15 req/s (TTFT p90 <= 500 ms fails before that, queueing) while a decode step at
  batch 32-64 is ~10-16 ms (TPOT fine); the co-located pair has two GPUs for prefill and should go
  further. 4 and 8 are below both knees, 12 is at the disaggregated knee, 16 beyond it;
- `sharegpt`: 1000 carried conversations (prompt <= 1024, answer clipped to 512 tokens), rates 5 10 20.
SLO: TTFT <= 500 ms and TPOT <= 50 ms per request; a rate is "good" at >= 90% attainment (DistServe).
70b (TP=2): a decode step ~4-5x the 8B's (~40 ms) and a 2k prefill ~250-350 ms, so: random ISL 2048 /
OSL 128 at 1 2 3 4 req/s (one TP=2 prefill worker saturates near 3-4), sharegpt at 2 4 8, SLO TTFT <=
1500 ms / TPOT <= 100 ms, 6 s of arrivals per rate, request timeout 60 s (a 512-token answer at 100 ms).
Rates, SLOs and duration: flags; the summary records them, the model, tp and the GPUs of every worker.
The runs of both workloads interleave by rate, so a deadline cut loses the top rates, not a workload.

Time: a global --deadline-s (default 480 s) from the start: a run that would not fit its
configuration's share of the time left is skipped (recorded), the second configuration gets the time
the first left, and a hard alarm 20 s past the deadline stops everything; whatever was measured is
still summarised. The time plan is logged at the start (8b and 70b both fit 480 s with ~90 s to start).
Output in --out (at most 7 files): summary.json, results.tar.gz (every run's bench JSON, the warm-up
runs, every process log, the model config), goodput_<workload>.png (the harness's plot: goodput +
TTFT/TPOT/ITL CDFs, both configurations) and attainment_<workload>.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from lab.experiments import distserve_assets as assets
from lab.experiments import distserve_report as report
from lab.experiments.distserve_cluster import Cluster
from lab.experiments.distserve_plan import (
    BLOCK_TOKENS,
    KV_GIB_PER_RANK,
    PROFILES,
    Plan,
    Workload,
    check_gpus,
    kv_bytes_per_block,
    make_plan,
)
from lab.experiments.handoff_phases import PHASE_PREFIXES, phase_summary
from lab.experiments.layouts import parse_layout
from lab.experiments.product_stack import ProductStack
from lab.experiments.run_metrics import SERVICE_PREFIXES, WORKER_PREFIXES, run_delta
from loadtest.metrics import GoodputCriterion
from services.common.cluster_auth import TOKEN_ENV, ClusterToken

log = logging.getLogger("lab.experiments.distserve")


class DeadlineExceeded(BaseException):  # noqa: N818 - BaseException: asyncio re-raises it out of the loop
    """The hard alarm: stop whatever runs, clean up, summarise what was measured."""


def bench(url: str, tokenizer: Path, dataset_args: tuple[str, ...], extra: list[str], out: Path,
          request_timeout_s: float, slo: tuple[float, float], api_key: str | None = None) -> int:
    """One `baton bench` invocation, in this process; returns its exit code."""
    from loadtest.cli import main as bench_main

    argv = [*(["--api-key", api_key] if api_key else []),
            "--base-url", url, "--tokenizer", str(tokenizer), "--ignore-eos", "--no-progress",
            "--request-timeout", f"{request_timeout_s:g}", "--slo-ttft-ms", f"{slo[0]:g}",
            "--slo-tpot-ms", f"{slo[1]:g}", "--result-json", str(out), "--label", out.stem.split("__")[0],
            *dataset_args, *extra]
    log.info("bench %s", " ".join(argv).replace(api_key, "bt-***") if api_key else " ".join(argv))
    return bench_main(argv)


def run_order(workloads: tuple[Workload, ...]) -> list[tuple[Workload, int]]:
    """Runs interleaved by rate index: random r0, sharegpt r0, random r1, ..."""
    depth = max(len(w.rates) for w in workloads)
    return [(w, i) for i in range(depth) for w in workloads if i < len(w.rates)]


def run_label(layout: str, stack: str, stacks: list[str]) -> str:
    """A run's name: the layout, with `+product` when the full product served it beside a bare run."""
    return f"{layout}+{stack}" if stack != "bare" or len(stacks) > 1 else layout


def run_configuration(config: str, plan: Plan, work: Path, deadline: float, configs_left: int,
                      record: dict, layout: str | None = None, stack: str = "bare") -> None:
    """One layout under one stack (`bare`: BATON_AUTH_MODE=none; `product`: auth, limits, safety, billing)."""
    token = ClusterToken.generate()  # the product's safety service asks for it, as the cluster's ports do
    if stack == "product":
        with ProductStack(work / "logs" / config, {TOKEN_ENV: token.value}) as product:
            _run_configuration(config, plan, work, deadline, configs_left, record, layout, product, token)
    else:
        _run_configuration(config, plan, work, deadline, configs_left, record, layout, None, token)


def _run_configuration(config: str, plan: Plan, work: Path, deadline: float, configs_left: int,
                       record: dict, layout: str | None, product: ProductStack | None, token: ClusterToken) -> None:
    entry: dict = {"runs": [], "skipped": [], "stack": "bare" if product is None else "product"}
    record["configurations"][config] = entry
    share_end = time.monotonic() + (deadline - time.monotonic()) / configs_left
    slo = (plan.spec.slo_ttft_ms, plan.spec.slo_tpot_ms)
    api_key = None if product is None else product.api_key
    log.warning("=== %s: starting (time share until +%.0f s)", config, share_end - time.monotonic())
    with Cluster(config, plan.spec, work / "logs", layout,
                 None if product is None else product.gateway_env, token) as cluster:
        entry["startup_s"] = cluster.startup_s
        entry["workers"] = {w.name: {"role": w.role, "gpus": list(w.gpus)} for w in cluster.plans}
        log.warning("%s: all processes ready in %.1f s", config, cluster.startup_s)
        for i, dataset in enumerate(plan.warmup):
            bench(cluster.url, plan.spec.model_dir, dataset, ["--seed", str(900 + i)],
                  work / "warmup" / f"{config}__warmup{i}.json", plan.request_timeout_s, slo, api_key)
        for workload, index in run_order(plan.workloads):
            rate = workload.rates[index]
            need = plan.duration_s + workload.drain_s + 3.0
            name = f"{config}__{workload.name}__r{rate:g}"
            if time.monotonic() + need > share_end:
                entry["skipped"].append({"run": name, "needed_s": need,
                                         "left_s": round(share_end - time.monotonic(), 1)})
                log.warning("%s: skipped (needs ~%.0f s, %.0f s left in this configuration's share)",
                            name, need, share_end - time.monotonic())
                continue
            started = time.monotonic()
            counters = cluster.worker_counters(PHASE_PREFIXES, buckets=True)
            services = cluster.service_counters(SERVICE_PREFIXES)
            engines = cluster.worker_counters(WORKER_PREFIXES, buckets=True)
            num = max(1, math.ceil(rate * plan.duration_s))
            seed = 1000 * [w.name for w in plan.workloads].index(workload.name) + index + 1
            code = bench(cluster.url, plan.spec.model_dir, workload.args,
                         ["--num-prompts", str(num), "--request-rate", f"{rate:g}", "--seed", str(seed),
                          "--max-duration", f"{1.5 * plan.duration_s:g}"], work / "runs" / f"{name}.json",
                         plan.request_timeout_s, slo, api_key)
            phases = phase_summary(counters, cluster.worker_counters(PHASE_PREFIXES, buckets=True))
            service_metrics = {**run_delta(services, cluster.service_counters(SERVICE_PREFIXES)),
                               **run_delta(engines, cluster.worker_counters(WORKER_PREFIXES, buckets=True))}
            entry["runs"].append({"run": name, "exit_code": code, "wall_s": round(time.monotonic() - started, 1),
                                  "handoff_phases": phases, "service_metrics": service_metrics})
            log.warning("%s: done in %.1f s (exit %d)", name, time.monotonic() - started, code)
        entry["worker_counters"] = cluster.worker_counters()


def write_outputs(work: Path, out: Path, record: dict) -> dict:
    """summary.json, the plots and results.tar.gz, from whatever runs finished."""
    (work / "runs").mkdir(parents=True, exist_ok=True)
    summary = report.summarize(work / "runs", record)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    try:
        report.plot(work / "runs", out, summary)
    except Exception as e:  # noqa: BLE001 - e.g. no matplotlib on the GPU box: --replot here later
        log.warning("plots not written (%s: %s); run --replot on a machine with matplotlib", type(e).__name__, e)
    if (work / "runs").resolve() != (out / "runs").resolve():
        with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
            for sub in ("runs", "warmup", "logs"):
                if (work / sub).exists():
                    tar.add(work / sub, arcname=sub)
            for extra in work.glob("*/config.json"):
                tar.add(extra, arcname=f"model/{extra.parent.name}-config.json")
    report.print_tables(summary)
    return summary


def replot(out: Path, slo: GoodputCriterion | None = None) -> int:
    """Summary and plots again from OUT/results.tar.gz; under another `slo` into OUT/slo-ttft<ms>-tpot<ms>/
    (the same requests judged by, e.g., a tight TPOT)."""
    dest = out if slo is None else out / f"slo-ttft{slo.ttft_ms:g}-tpot{slo.tpot_ms:g}"
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distserve-replot-") as tmp:
        with tarfile.open(out / "results.tar.gz") as tar:
            tar.extractall(tmp, filter="data")
        old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        meta = {k: v for k, v in old.items() if k != "workloads"}
        summary = report.summarize(Path(tmp) / "runs", meta, slo)
        (dest / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        report.plot(Path(tmp) / "runs", dest, summary)
        report.print_tables(summary)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lab.experiments.distserve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/distserve"))
    p.add_argument("--smoke", action="store_true", help="CPU: default tiny model, torch backend, tiny rates")
    p.add_argument("--replot", type=Path, default=None, metavar="OUT", help="only redo summary + plots of OUT")
    p.add_argument("--replot-slo", type=float, nargs=2, default=None, metavar=("TTFT_MS", "TPOT_MS"),
                   help="with --replot: judge the same requests by this SLO (into OUT/slo-ttft<ms>-tpot<ms>/)")
    p.add_argument("--configs", nargs="+", default=["disagg", "colocated"], metavar="LAYOUT",
                   help="layouts, one after another: c<N> (co-located), <X>p<Y>d, disagg (= 1p1d), colocated (= c2); "
                        "4 GPUs: c4 1p3d 2p2d 3p1d")
    p.add_argument("--stacks", nargs="+", choices=["bare", "product"], default=["bare"],
                   help="what serves each layout: bare (BATON_AUTH_MODE=none, no safety: the engine's path) and/or "
                        "product (API keys in Postgres, RPM+TPM limits in Redis, safety, billing through Kafka)")
    p.add_argument("--model-shape", choices=sorted(assets.SHAPES), default=None, help="GPU model (default 8b)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (= GPUs) per worker")
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"KV blocks of {BLOCK_TOKENS} tokens per worker (default: {KV_GIB_PER_RANK} GiB per rank; "
                        "smoke 512)")
    p.add_argument("--random-rates", type=float, nargs="*", default=None,
                   help="default: per model (see above); the flag alone leaves the workload out")
    p.add_argument("--sharegpt-rates", type=float, nargs="*", default=None)
    p.add_argument("--random-len", type=int, nargs=2, default=None, metavar=("ISL", "OSL"),
                   help="the random workload's prompt and output lengths (default: per model, 8b 2048 128)")
    p.add_argument("--duration-s", type=float, default=None, help="arrivals per rate (8b 10, 70b 6, smoke 4)")
    p.add_argument("--deadline-s", type=float, default=None, help="whole run (default 480; smoke 900)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="8b 500, 70b 1500, smoke 5000")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="8b 50, 70b 100, smoke 1000")
    p.add_argument("--policy", default="least_loaded", help="scheduler policy")
    p.add_argument("--scheduler-profile", type=Path, default=None, metavar="JSON",
                   help="a `baton profile` of the card: the scheduler's cost-model seed (the goodput policy's)")
    p.add_argument("--tap-scheduler", action="store_true",
                   help="record the scheduler's decisions and step samples (logs/<layout>-scheduler_tap.json) for "
                        "`python -m lab.experiments.tpot_forecast OUT`: predicted against measured TTFT/TPOT")
    p.add_argument("--worker-args", default="", metavar="ARGS",
                   help="more `baton worker` flags for every worker, one string (an A/B of a worker setting: "
                        "--worker-args=\"--gil-switch-interval-ms 0.2\")")
    p.add_argument("--gateway-processes", type=int, default=None,
                   help="gateway processes sharing its port (default: 4 on GPUs, where one event loop's ~7-8k "
                        "tokens/s would cap the layouts being compared; 1 with --smoke)")
    args = p.parse_args(argv)
    if args.smoke and (args.tp != 1 or args.model_shape):
        p.error("--smoke runs the default tiny CPU model (9 query / 3 KV heads: no split over ranks); "
                "--tp and --model-shape are for GPU runs")
    try:
        args.layouts = [parse_layout(c) for c in args.configs]
    except ValueError as e:
        p.error(str(e))
    args.model_shape = args.model_shape or "8b"
    hf = assets.SHAPES[args.model_shape][1]
    if args.tp < 1 or hf["num_attention_heads"] % args.tp:
        p.error(f"--tp {args.tp}: must be >= 1 and divide the {hf['num_attention_heads']} attention heads of "
                f"{args.model_shape}")
    prof = PROFILES["smoke" if args.smoke else args.model_shape]
    if not args.num_blocks:
        args.num_blocks = 512 if args.smoke else KV_GIB_PER_RANK * 2**30 // kv_bytes_per_block(hf, args.tp)
    args.random_rates = prof.random_rates if args.random_rates is None else args.random_rates
    args.sharegpt_rates = prof.sharegpt_rates if args.sharegpt_rates is None else args.sharegpt_rates
    if not args.random_rates and not args.sharegpt_rates:
        p.error("no workload left: give rates to --random-rates or --sharegpt-rates")
    args.duration_s = args.duration_s or prof.duration_s
    args.deadline_s = args.deadline_s or (900.0 if args.smoke else 480.0)
    args.gateway_processes = args.gateway_processes or (1 if args.smoke else 4)
    args.slo_ttft_ms = args.slo_ttft_ms or prof.slo_ms[0]
    args.slo_tpot_ms = args.slo_tpot_ms or prof.slo_ms[1]
    return args


def log_time_plan(plan: Plan, args: argparse.Namespace) -> None:
    prof = PROFILES["smoke" if args.smoke else args.model_shape]
    runs_s = sum(plan.duration_s + w.drain_s + 3.0 for w in plan.workloads for _ in w.rates)
    share = args.deadline_s / (len(args.configs) * len(args.stacks))
    log.warning("time plan per configuration: ~%.0f s start + warm-up, ~%.0f s of runs; share %.0f s%s",
                prof.startup_s, runs_s, share, " (top rates may be skipped)" if prof.startup_s + runs_s > share else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if args.replot is not None:
        override = args.replot_slo is not None
        return replot(args.replot, GoodputCriterion(*args.replot_slo) if override else None)
    missing = assets.missing_assets()
    if missing:
        print(f"distserve: missing {missing} in {assets.ASSET_DIR}: run python -m "
              "lab.experiments.distserve_assets first (and carry .data/)", file=sys.stderr)
        return 2
    record: dict = {"experiment": "distserve", "smoke": args.smoke, "policy": args.policy,
                    "gateway_processes": args.gateway_processes,
                    "scheduler_profile": None if args.scheduler_profile is None
                    else json.loads(args.scheduler_profile.read_text()),
                    "model_shape": None if args.smoke else args.model_shape, "tp": args.tp,
                    "gpus_per_worker": None if args.smoke else args.tp,
                    "gpus_total": None if args.smoke else max(lay.gpus(args.tp) for lay in args.layouts),
                    "layout_gpus": {run_label(c, st, args.stacks): lay.gpus(args.tp)
                                    for c, lay in zip(args.configs, args.layouts, strict=True) for st in args.stacks},
                    "stacks": args.stacks, "num_blocks": args.num_blocks,
                    "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": 0.9},
                    "host": {"python": sys.version.split()[0], "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")},
                    "configurations": {}, "errors": []}
    why = None if args.smoke else check_gpus(args, record)
    if why:
        print(f"distserve: {why}", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = started + args.deadline_s

    def on_alarm(signum: int, _frame: object) -> None:
        raise DeadlineExceeded(f"signal {signum}: past the deadline ({args.deadline_s:.0f} s) or told to stop")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_alarm)
    signal.alarm(int(args.deadline_s) + 20)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="distserve-"))
    plan = make_plan(work, args)
    record.update(duration_s_per_rate=plan.duration_s, request_timeout_s=plan.request_timeout_s,
                  engine_args=list(plan.spec.engine_args), model=plan.spec.model_name,
                  workload_defs=[w.__dict__ for w in plan.workloads])
    log_time_plan(plan, args)
    rc = 0
    try:
        targets = [(layout, stack) for layout in args.configs for stack in args.stacks]
        for i, (layout, stack) in enumerate(targets):
            config = run_label(layout, stack, args.stacks)
            try:
                run_configuration(config, plan, work, deadline, len(targets) - i, record, layout, stack)
            except Exception as e:  # noqa: BLE001 - the other configuration may still run
                record["errors"].append(f"{config}: {type(e).__name__}: {e}"[:4000])
                log.error("%s failed: %s", config, e)
                rc = 1
    except DeadlineExceeded as e:
        record["errors"].append(str(e))
        log.error("%s", e)
        rc = 1
    finally:
        signal.alarm(0)
        record["wall_s"] = round(time.monotonic() - started, 1)
        try:
            write_outputs(work, args.out, record)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.warning("distserve finished in %.0f s (exit %d); outputs in %s", time.monotonic() - started, rc, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
