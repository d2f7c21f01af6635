"""What the gateway's event loop costs on this host, per request and per streamed token, from layout runs.

    python -m lab.experiments.gateway_cost OUT [OUT ...] [--json FILE]

OUT: outputs of `lab/suites/layouts_suite.sh` (their summary.json keeps each run's service metrics,
lab/experiments/run_metrics.py). Per run: the CPU seconds of the gateway's event-loop thread
(`baton_gateway_event_loop_cpu_seconds`), the generations it finished and the completion tokens it
streamed. The fit (scheduler/calibration/gateway.py) is least squares over the runs, both costs
non-negative:

    loop CPU = per_request * generations + per_token * completion tokens

A `baton plan` input (`--gateway-token-us`, `--gateway-request-ms`): the planner simulates the gateway's
loop as a round robin over its open streams (scheduler/sim/gateway.py), and on the 4xH100 hosts of
docs/benchmarks.md the per-token cost that replays those hosts' runs best (140 us, with 2.66 ms per
request held) is what this fit measures from their loop CPU (138 us on machine L; 121 on J; 86 on M, a
faster host). The earlier model, one FIFO queue of tokens, needed a per-token cost well under the measured
one to keep its TTFT from exploding: a FIFO makes a new request's first token wait behind every token
queued, where the real loop reads one message per stream at a time. Counted on machine L at 34-46
ShareGPT requests/s: one worker stream message per token (`baton_gateway_worker_messages`; the tokens
per message column below), so a worker's coalescing of unread tokens (services/worker/decode_jobs.py)
does not lower the cost per token on those runs. The run averages mix ramp-up and drain with the peak;
the fit is a host's average, which is what the planner takes.
Runs of a single workload all stream about the same tokens per request, which leaves the two costs
inseparable: then the per-request cost stays at `--request-ms` (default: the planner's) and only the
per-token cost is fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scheduler.calibration.gateway import GatewayFit, GatewayRun, fit_gateway_cost
from scheduler.sim.gateway import MEASURED_GATEWAY

LOOP_CPU = "baton_gateway_event_loop_cpu_seconds_total"
TOKENS = "baton_gateway_tokens_total"
FINISHED = "baton_gateway_generations_finished_total"
MESSAGES = "baton_gateway_worker_messages_total"

def gateway_runs(summary: dict[str, Any]) -> list[GatewayRun]:
    """The runs of a layouts_suite summary.json whose gateway reported its loop CPU."""
    runs = []
    for config in (summary.get("configurations") or {}).values():
        for entry in config.get("runs", []):
            gateway = (entry.get("service_metrics") or {}).get("gateway") or {}
            cpu = gateway.get(LOOP_CPU)
            if cpu is None:
                continue
            messages = int(_sum_of(gateway, MESSAGES)) if MESSAGES in gateway else None
            runs.append(GatewayRun(entry["run"], float(cpu), int(_sum_of(gateway, FINISHED)),
                                   int(_sum_of(gateway, TOKENS, "kind=completion")), messages))
    return [r for r in runs if r.generations > 0]


def _sum_of(series: dict[str, Any], name: str, label: str | None = None) -> float:
    """A counter's increase summed over its label sets (those carrying `label` only, when given)."""
    total = 0.0
    for key, value in series.items():
        if key.split("{")[0] == name and (label is None or label in key) and isinstance(value, int | float):
            total += value
    return total


def load_fit(outs: list[Path], request_s: float = MEASURED_GATEWAY.per_request_s) -> GatewayFit:
    runs = []
    for out in outs:
        summary = out / "summary.json"
        if summary.exists():
            runs += gateway_runs(json.loads(summary.read_text()))
    return fit_gateway_cost(runs, request_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.experiments.gateway_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outs", type=Path, nargs="+", help="layouts_suite.sh outputs")
    p.add_argument("--request-ms", type=float, default=MEASURED_GATEWAY.per_request_s * 1e3,
                   help="per-request cost held when the runs cannot separate it")
    p.add_argument("--json", type=Path, default=None, help="also write the fit here")
    args = p.parse_args(argv)
    try:
        result = load_fit(args.outs, args.request_ms / 1e3)
    except ValueError as e:
        print(f"gateway_cost: {e}", file=sys.stderr)
        return 2
    print(f"{'run':28} {'loop CPU s':>10} {'requests':>9} {'tokens':>8} {'us/token':>9} {'tokens/message':>14}")
    for r in result.runs:
        per_message = "-" if not r.worker_messages else f"{r.completion_tokens / r.worker_messages:.2f}"
        print(f"{r.run:28} {r.loop_cpu_s:10.2f} {r.generations:9d} {r.completion_tokens:8d} "
              f"{r.loop_cpu_s / max(r.completion_tokens, 1) * 1e6:9.1f} {per_message:>14}")
    held = "" if result.both_fitted else " (per-request cost held: one tokens-per-request ratio in the runs)"
    print(f"fit{held}: {result.cost.per_request_s * 1e3:.3g} ms per request + {result.cost.per_token_s * 1e6:.3g} "
          f"us per streamed token; mean |error| per run {result.mean_abs_error:.1%}")
    print(f"as baton plan flags: {result.flags()}")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
