"""How well a simulated replay of measured runs matches them: what a grid search over simulated costs
minimises (lab/experiments/gateway_replay_fit.py searches `GatewayCost`s with it).

Each run's measured and simulated sides are compared by the mean |log(simulated / measured)| of TTFT p50
and p90 and TPOT p50 and p90 (so 0.1 is ~10% off), and by the mean attainment error, over the runs that
served at least `MIN_ATTAINMENT` of their requests within the SLO (past that the percentiles are of the
few served).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.sim.gateway import GatewayCost


@dataclass(frozen=True)
class Side:
    attainment: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    refused: int  # measured: failed requests (503s); simulated: admission rejections
    remote: int | None  # prompts prefilled on a prefill worker; None: not known
    # Means over remote prefills (None: none, or not kept): the prefill worker's prefill_compute phase
    # and the decode worker's hand-off overhead phase (services/worker/metrics.py HandoffPhase).
    prefill_compute_ms: float | None = None
    overhead_ms: float | None = None


@dataclass(frozen=True)
class Row:
    run: str
    measured: Side
    simulated: Side


PERCENTILES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")
MIN_ATTAINMENT = 0.5  # runs below it are left out of the score


@dataclass(frozen=True)
class Score:
    cost: GatewayCost
    log_errors: dict[str, float]  # mean |log(simulated / measured)| per percentile
    attainment_error: float  # mean |simulated - measured| attainment
    runs: int

    @property
    def total(self) -> float:
        return sum(self.log_errors.values())


def score(cost: GatewayCost, rows: Sequence[Row]) -> Score:
    kept = [r for r in rows if r.measured.attainment >= MIN_ATTAINMENT]
    errors: dict[str, list[float]] = {name: [] for name in PERCENTILES}
    for row in kept:
        for name in PERCENTILES:
            measured, simulated = getattr(row.measured, name), getattr(row.simulated, name)
            if measured and simulated:
                errors[name].append(abs(math.log(simulated / measured)))
    attainment = [abs(r.simulated.attainment - r.measured.attainment) for r in kept]
    return Score(cost, {name: _mean(values) for name, values in errors.items()}, _mean(attainment), len(kept))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
