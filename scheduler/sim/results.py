"""What a replay measured: per-request latencies and the goodput that policies are compared on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler.types import Tier


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    tier: Tier
    arrival_s: float
    ttft_s: float | None  # None: not served (rejected, timed out, or unfinished at the horizon)
    tpot_s: float | None  # mean over tokens after the first; 0.0 for one-token answers
    e2e_s: float | None
    met_slo: bool  # finished with TTFT and TPOT within the request's targets
    rejected: bool
    degraded: bool
    queued: bool  # waited in the scheduler's admission queue at some point
    decode_worker_id: str | None
    prefill_worker_id: str | None  # None with a decode worker: prefilled locally
    # A remote prefill's first chunk scheduled -> its last chunk done (the prefill worker's
    # prefill_compute phase); None for local prefills and unserved requests.
    prefill_compute_s: float | None = None
    handoff_overhead_s: float | None = None  # a remote prefill's decode-side `overhead` phase (replay.py)
    timed_out: bool = False  # its client gave up before the answer was complete (ReplayConfig.clients)


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    outcomes: tuple[RequestOutcome, ...]
    duration_s: float  # simulated time from the first arrival to the last event

    @property
    def goodput(self) -> float:
        """Requests meeting both SLOs over all requests; rejected and unfinished ones are misses."""
        return _fraction(self.outcomes, lambda o: o.met_slo)

    @property
    def rejected(self) -> int:
        return sum(o.rejected for o in self.outcomes)

    @property
    def degraded(self) -> int:
        return sum(o.degraded for o in self.outcomes)

    def goodput_by_tier(self) -> dict[Tier, float]:
        return {
            tier: _fraction([o for o in self.outcomes if o.tier is tier], lambda o: o.met_slo)
            for tier in Tier
            if any(o.tier is tier for o in self.outcomes)
        }

    def percentile_ms(self, metric: str, q: float) -> float | None:
        """Percentile `q` (0-100) of `ttft_s`, `tpot_s` or `e2e_s` over served requests, in ms."""
        if metric not in ("ttft_s", "tpot_s", "e2e_s"):
            raise ValueError(f"unknown metric {metric!r}; valid: ttft_s, tpot_s, e2e_s")
        values: list[float] = sorted(v for o in self.outcomes if (v := getattr(o, metric)) is not None)
        if not values:
            return None
        index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
        return values[index] * 1e3

    def summary(self) -> str:
        tiers = " ".join(f"{t.value}={g:.1%}" for t, g in self.goodput_by_tier().items())
        p50_ttft = self.percentile_ms("ttft_s", 50) or 0.0
        p90_ttft = self.percentile_ms("ttft_s", 90) or 0.0
        p90_tpot = self.percentile_ms("tpot_s", 90) or 0.0
        return (
            f"{self.policy:<13} goodput={self.goodput:6.1%} ({tiers}) rejected={self.rejected} "
            f"ttft p50/p90={p50_ttft:.0f}/{p90_ttft:.0f} ms tpot p90={p90_tpot:.1f} ms"
        )


def _fraction(
    outcomes: tuple[RequestOutcome, ...] | list[RequestOutcome], test: Callable[[RequestOutcome], bool]
) -> float:
    if not outcomes:
        return 0.0
    return sum(test(o) for o in outcomes) / len(outcomes)
