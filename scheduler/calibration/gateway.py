"""What the gateway's event loop costs per request and per streamed token, fitted to measured runs.

    loop CPU = per_request * generations + per_token * completion tokens

Least squares over runs (each: the loop thread's CPU seconds, the generations it finished, the tokens it
streamed), both costs non-negative; the result is the `GatewayCost` `baton plan` takes
(`--gateway-request-ms`, `--gateway-token-us`; scheduler/sim/gateway.py). Runs of a single workload all
stream about the same tokens per request, which leaves the two costs inseparable: then the per-request
cost is held and only the per-token cost is fitted. lab/experiments/gateway_cost.py reads the runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.sim.gateway import MEASURED_GATEWAY, GatewayCost

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


def fit_gateway_cost(runs: list[GatewayRun], request_s: float = MEASURED_GATEWAY.per_request_s) -> GatewayFit:
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
