"""What the gateway's event loop costs on this host, per request and per streamed token, from layout runs.

    python -m loadtest.experiments.gateway_cost OUT [OUT ...] [--json FILE]

OUT: outputs of `loadtest/micro/layouts_suite.sh` (their summary.json keeps each run's service metrics,
loadtest/experiments/run_metrics.py). Per run: the CPU seconds of the gateway's event-loop thread
(`baton_gateway_event_loop_cpu_seconds`), the generations it finished and the completion tokens it
streamed. The fit is least squares over the runs, both costs non-negative:

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.sim.gateway import MEASURED_GATEWAY, GatewayCost

LOOP_CPU = "baton_gateway_event_loop_cpu_seconds_total"
TOKENS = "baton_gateway_tokens_total"
FINISHED = "baton_gateway_generations_finished_total"
MESSAGES = "baton_gateway_worker_messages_total"
# Tokens per request must spread by this much (max/min over the runs) to fit both costs.
SEPARABLE_SPREAD = 1.3


@dataclass(frozen=True)
class GatewayRun:
    run: str
    loop_cpu_s: float
    generations: int
    completion_tokens: int
    worker_messages: int | None = None  # None: the gateway did not count them yet


@dataclass(frozen=True)
class GatewayFit:
    cost: GatewayCost
    both_fitted: bool  # False: the per-request cost was held (one tokens-per-request ratio in the runs)
    runs: tuple[GatewayRun, ...]
    mean_abs_error: float  # of the fitted loop CPU per run, relative

    def flags(self) -> str:
        """The fit as `baton plan` flags (see the module docstring before using them there)."""
        return (f"--gateway-request-ms {self.cost.per_request_s * 1e3:.3g} "
                f"--gateway-token-us {self.cost.per_token_s * 1e6:.3g}")


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


def fit(runs: list[GatewayRun], request_s: float = MEASURED_GATEWAY.per_request_s) -> GatewayFit:
    """Least squares over `runs` (see the module docstring); `request_s`: the per-request cost held when
    the runs cannot separate it."""
    if not runs:
        raise ValueError("no run with the gateway's loop CPU (baton_gateway_event_loop_cpu_seconds): "
                         "runs from before the gateway counted it cannot be fitted")
    cpu = np.array([r.loop_cpu_s for r in runs])
    x = np.array([[r.generations, r.completion_tokens] for r in runs], dtype=float)
    ratio = x[:, 1] / x[:, 0]
    both = len(runs) >= 2 and ratio.max() / max(ratio.min(), 1e-9) >= SEPARABLE_SPREAD
    if both:
        coefficients = _nonnegative_lstsq(x, cpu)
    else:
        per_token = float(np.dot(x[:, 1], cpu - request_s * x[:, 0]) / np.dot(x[:, 1], x[:, 1]))
        coefficients = np.array([request_s, max(per_token, 0.0)])
    predicted = x @ coefficients
    error = float(np.mean(np.abs(predicted - cpu) / np.maximum(cpu, 1e-9)))
    cost = GatewayCost(per_request_s=float(coefficients[0]), per_token_s=float(coefficients[1]))
    return GatewayFit(cost, both, tuple(runs), error)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Two-coefficient least squares with each >= 0 (a negative cost pinned at 0, the other refitted)."""
    solved = np.linalg.lstsq(x, y, rcond=None)[0]
    if (solved >= 0).all():
        return solved
    keep = int(np.argmax(solved))
    column = x[:, keep]
    out = np.zeros(2)
    out[keep] = max(float(np.dot(column, y) / np.dot(column, column)), 0.0)
    return out


def load_fit(outs: list[Path], request_s: float = MEASURED_GATEWAY.per_request_s) -> GatewayFit:
    runs = []
    for out in outs:
        summary = out / "summary.json"
        if summary.exists():
            runs += gateway_runs(json.loads(summary.read_text()))
    return fit(runs, request_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.experiments.gateway_cost", description=__doc__,
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
