"""`baton plan`: recommend a prefill:decode layout for a workload, SLOs and a GPU count (scheduler/planner.py).

    baton plan --gpus 4 --profile h100.json --prompt-tokens 2048 --output-tokens 128 --rate 8 \\
        --ttft-ms 500 --tpot-ms 50 [--profile-tp 2=h100-tp2.json] [--json plan.json]
    baton plan --gpus 8 --profile h100.json --trace trace.jsonl ...

`--profile` is what `baton profile` writes (one profile, or {model: profile}; `--model` picks one);
`--profile-tp N=FILE` adds the profile of a TP=N worker, which makes TP=N layouts candidates;
`--profile-tp NxM=FILE` that of a worker of N tensor ranks x M pipeline stages (N*M GPUs).
A trace is JSON lines with `time_s`, `prompt_tokens`, `output_tokens`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scheduler.adapters.profiles import ANY_MODEL, ProfileBook
from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import SyntheticLengths, synthetic_trace, trace_from_rows
from scheduler.planner import DEFAULT_HANDOFF_S, Plan, PlanConfig, WorkerShape, plan
from scheduler.sim.gateway import GatewayCost
from scheduler.sim.serving import ServingCost
from scheduler.sim.trace import Arrival
from scheduler.types import SLO


def register_plan_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="simulate co-located and xPyD layouts of N GPUs; recommend one")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--profile", required=True, metavar="FILE", help="a `baton profile` JSON (TP=1 workers)")
    p.add_argument("--profile-tp", action="append", default=[], metavar="N[xM]=FILE",
                   help="the profile of TP=N workers, or of TP=N x PP=M workers (repeatable): adds their layouts")
    p.add_argument("--model", default=None, help="which model of a multi-model profile file")
    workload = p.add_argument_group("workload: a trace, or length distributions + rate")
    workload.add_argument("--trace", default=None, metavar="JSONL")
    workload.add_argument("--prompt-tokens", default="2048", help="N, uniform:A:B or lognormal:MEDIAN:SIGMA")
    workload.add_argument("--output-tokens", default="128", help="as --prompt-tokens")
    workload.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    workload.add_argument("--requests", type=int, default=400)
    p.add_argument("--ttft-ms", type=float, default=500.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment a layout must keep (0-1]")
    p.add_argument("--no-search", action="store_true", help="rank by goodput at the workload's rate only")
    p.add_argument("--search-tolerance", type=float, default=PlanConfig.search_tolerance,
                   help="bisect each layout's rate until the bracket is this narrow, relative (default 0.02)")
    p.add_argument("--seeds", type=int, default=PlanConfig.seeds,
                   help="step-noise seeds replayed per rate, attainment averaged (default 3)")
    p.add_argument("--tie-margin", type=float, default=PlanConfig.tie_margin,
                   help="layouts within this share of the best score tie; fewer prefill GPUs wins (default 0.05)")
    p.add_argument("--handoff-ms", type=float, default=DEFAULT_HANDOFF_S * 1e3,
                   help="KV hand-off overhead per remote prefill (default: measured p50, docs/benchmarks.md)")
    serving = PlanConfig.serving
    p.add_argument("--serving-step-ms", type=float, default=serving.per_step_s * 1e3,
                   help="a served step's cost beyond the profile, per step (default: measured on 4xH100, "
                        "docs/benchmarks.md; fit your own with lab/experiments/serving_cost.py)")
    p.add_argument("--serving-seq-us", type=float, default=serving.per_seq_s * 1e6,
                   help="the same, per sequence in the step")
    p.add_argument("--serving-prefill-step-ms", type=float, default=serving.per_prefill_step_s * 1e3,
                   help="the same, added to a step that carries prefill for another worker (default: measured "
                        "on 4xH100; fit your own with lab/experiments/prefill_serving_cost.py)")
    p.add_argument("--serving-prefill-done-ms", type=float, default=serving.per_prefill_done_s * 1e3,
                   help="the same, per prompt whose prefill ends in the step and is handed over")
    p.add_argument("--serving-context-ns", type=float, default=serving.per_context_token_s * 1e9,
                   help="the same, per context token of the decoding sequences")
    p.add_argument("--serving-sampled-share", type=float, default=serving.sampled_share,
                   help="the share of the serving cost inside the workers' engine loop, so in the step samples "
                        "the simulated scheduler learns from (default: measured on 1xH200, docs/benchmarks.md)")
    gateway = PlanConfig.gateway
    p.add_argument("--gateway-request-ms", type=float, default=gateway.per_request_s * 1e3,
                   help="the gateway's CPU per request (default: measured on 4xH100, docs/benchmarks.md); "
                        "0 with the token cost below models a gateway that never queues")
    p.add_argument("--gateway-token-us", type=float, default=gateway.per_token_s * 1e6,
                   help="the gateway's CPU per streamed token, per process (its processes front every layout)")
    p.add_argument("--gateway-processes", type=int, default=gateway.processes,
                   help="gateway processes sharing its port (BATON_GATEWAY_PROCESSES), each its own event loop")
    p.add_argument("--gateway-admission-rounds", type=float, default=gateway.admission_rounds,
                   help="turns of the gateway's event loop over its open streams that a request waits on its "
                        "way in (scheduler/sim/gateway.py)")
    p.add_argument("--kv-blocks-per-gpu", type=int, default=PlanConfig.kv_blocks_per_gpu)
    p.add_argument("--block-size", type=int, default=PlanConfig.block_size)
    p.add_argument("--host-kv-blocks-per-gpu", type=int, default=0,
                   help="the host-memory KV tier per GPU, in blocks (the workers' --host-kv-gib over a block's "
                        "bytes; 0: none)")
    p.add_argument("--host-kv-load-us-per-block", type=float, default=PlanConfig.host_load_s_per_block * 1e6,
                   help="time to load one block from host memory (block bytes / host-to-GPU bandwidth)")
    p.add_argument("--max-batch", type=int, default=PlanConfig.max_batch, help="max_num_seqs per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="also write every layout's figures here")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    try:
        profiles = _profiles(args)
        config = PlanConfig(
            gpus=args.gpus, slo=SLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms),
            kv_blocks_per_gpu=args.kv_blocks_per_gpu, block_size=args.block_size,
            host_kv_blocks_per_gpu=args.host_kv_blocks_per_gpu,
            host_load_s_per_block=args.host_kv_load_us_per_block / 1e6, max_batch=args.max_batch,
            handoff_s=args.handoff_ms / 1e3, seed=args.seed, attainment_target=args.attainment,
            serving=ServingCost(per_step_s=args.serving_step_ms / 1e3, per_seq_s=args.serving_seq_us / 1e6,
                                per_prefill_step_s=args.serving_prefill_step_ms / 1e3,
                                per_prefill_done_s=args.serving_prefill_done_ms / 1e3,
                                per_context_token_s=args.serving_context_ns / 1e9,
                                sampled_share=args.serving_sampled_share),
            gateway=GatewayCost(per_request_s=args.gateway_request_ms / 1e3, per_token_s=args.gateway_token_us / 1e6,
                                admission_rounds=args.gateway_admission_rounds, processes=args.gateway_processes),
            search_rate=not args.no_search, search_tolerance=args.search_tolerance, seeds=args.seeds,
            tie_margin=args.tie_margin,
        )
        result = plan(_trace(args), profiles, config)
    except (OSError, ValueError) as e:
        print(f"baton plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result, config))
    if args.json:
        Path(args.json).write_text(json.dumps(plan_json(result, config), indent=2) + "\n")
    return 0


def _profiles(args: argparse.Namespace) -> dict[WorkerShape, WorkerProfile]:
    profiles = {WorkerShape(): _one_profile(args.profile, args.model)}
    for item in args.profile_tp:
        size, sep, path = item.partition("=")
        try:
            shape = WorkerShape.parse(size)
        except ValueError as e:
            raise ValueError(f"--profile-tp {item!r}: expected N=FILE or NxM=FILE with N, M >= 1") from e
        if not sep:
            raise ValueError(f"--profile-tp {item!r}: expected N=FILE or NxM=FILE with N, M >= 1")
        profiles[shape] = _one_profile(path, args.model)
    return profiles


def _one_profile(path: str, model: str | None) -> WorkerProfile:
    book = ProfileBook.load(path)
    if model is not None:
        found = book.for_model(model)
        if found is None:
            raise ValueError(f"{path}: no profile for model {model!r}; it has {sorted(book.by_model)}")
        return found
    if len(book.by_model) == 1:
        return next(iter(book.by_model.values()))
    if ANY_MODEL in book.by_model:
        return book.by_model[ANY_MODEL]
    raise ValueError(f"{path} holds profiles for {sorted(book.by_model)}: pick one with --model")


def _trace(args: argparse.Namespace) -> list[Arrival]:
    if args.trace:
        rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
        return trace_from_rows(rows, args.block_size)
    return synthetic_trace(SyntheticLengths.parse(args.prompt_tokens), SyntheticLengths.parse(args.output_tokens),
                           args.rate, args.requests, args.seed, args.block_size)


def format_plan(result: Plan, config: PlanConfig) -> str:
    target = f"rate at >= {config.attainment_target:.0%}"
    lines = [f"{'layout':<26} {'attainment':>10} {'goodput req/s':>14} {target:>16} {'TTFT p90':>9} {'TPOT p90':>9}"]
    for r in result.results:
        capacity = "-" if r.capacity_rps is None else f"{r.capacity_rps:.2f}"
        lines.append(f"{r.layout.name:<26} {r.attainment:>10.1%} {r.goodput_rps:>14.2f} {capacity:>16} "
                     f"{_ms(r.ttft_p90_ms):>9} {_ms(r.tpot_p90_ms):>9}")
    best = result.best
    per_gpu = best.score / config.gpus
    lines.append(f"recommended: {best.layout.name} ({per_gpu:.2f} req/s per GPU within "
                 f"TTFT <= {config.slo.ttft_ms:g} ms, TPOT <= {config.slo.tpot_ms:g} ms)")
    return "\n".join(lines)


def plan_json(result: Plan, config: PlanConfig) -> dict[str, object]:
    return {
        "gpus": config.gpus, "slo": {"ttft_ms": config.slo.ttft_ms, "tpot_ms": config.slo.tpot_ms},
        "attainment_target": config.attainment_target, "recommended": result.best.layout.name,
        "layouts": [{"layout": r.layout.name, "prefill_workers": r.layout.prefill_workers,
                     "decode_workers": r.layout.decode_workers, "prefill_tp": r.layout.prefill_tp,
                     "decode_tp": r.layout.decode_tp, "prefill_pp": r.layout.prefill_pp,
                     "decode_pp": r.layout.decode_pp, "colocated": r.layout.colocated,
                     "attainment": r.attainment, "goodput_rps": r.goodput_rps, "capacity_rps": r.capacity_rps,
                     "ttft_p90_ms": r.ttft_p90_ms, "tpot_p90_ms": r.tpot_p90_ms} for r in result.results],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"
