"""Where a prompt is prefilled, per request, by predicted cost: a prefill worker or the decode worker.

Remote: the prefill worker's queue + its compute + the hand-off (the KV the decode worker lacks
crossing the link, and the decode worker's step boundaries it waits for). The running batch on the
decode worker does not notice.
Local: the decode worker's own prefill queue + the prompt's compute, in steps shared with its
decode batch; and every running sequence there waits for that compute, which raises their TPOT
(`placement.local_interference_s`).

The two are compared in one unit, the fraction of SLO budget consumed:

    cost(remote) = ttft / ttft_target
    cost(local)  = ttft / ttft_target + weight * running * added_tpot / tpot_limit

so short prompts (cheap compute, a hop that costs more), prompts mostly cached on the decode
worker (little to compute, little to send) and a busy prefill fleet (a long queue) stay local,
and a long prompt next to a large running batch goes remote. Among the options, those that meet the
SLO come first (the cheapest of them wins), so cost only breaks ties between feasible choices.

Only a `decode` worker can take a remote prefill (a `both` worker has no KV link). Prefill workers
are ranked once per request by when they would finish it (queue + compute, their own prefix
cache counted) and only the best `remote_candidates` are priced against each decode worker: that
keeps a decision O(decode workers), not O(decode x prefill) (lab/micro/bench_scheduler_decisions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from mypy_extensions import mypyc_attr

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.placement import DecodeSide, Placement, PrefillSide, decode_side, evaluate, prefill_side
from scheduler.types import RequestSummary, SiteReason, WorkerRole


@dataclass(frozen=True)
class SitingConfig:
    # Fewer uncached tokens than this never cross the link: a guard the cost agrees with on every
    # measured card (a 32-token prefill is < 1 ms; the hand-off overhead alone is ~13 ms p50).
    min_remote_tokens: int = 32
    interference_weight: float = 1.0  # how much the running batch's TPOT counts against local
    # Best-ranked prefill workers priced per decode worker. One is exact when the prefill workers
    # share a transfer profile: only the hand-off depends on the decode worker, and it is the same
    # whichever prefill worker sends; raise it for prefill workers on different links.
    remote_candidates: int = 1
    cache_hit_fraction: float = 0.5  # a local choice with at least this much cached says DECODE_CACHE_HIT

    def __post_init__(self) -> None:
        if self.min_remote_tokens < 0 or self.interference_weight < 0 or self.remote_candidates < 1:
            raise ValueError("need min_remote_tokens >= 0, interference_weight >= 0, remote_candidates >= 1")
        if not 0.0 <= self.cache_hit_fraction <= 1.0:
            raise ValueError(f"cache_hit_fraction must be in [0, 1], got {self.cache_hit_fraction}")


@dataclass(slots=True)  # not frozen: built per priced worker (see placement.Placement)
class SiteChoice:
    placement: Placement
    reason: SiteReason
    cost: float  # fraction of the SLO budget consumed (see the module docstring)


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (scheduler/native.py), still open to other rules
class PrefillSiting:
    """Chooses the prefill site for a request on one decode worker. Pure; no state between calls."""

    def __init__(self, config: SitingConfig | None = None) -> None:
        self.config = config or SitingConfig()

    def remote_pool(self, request: RequestSummary, view: ClusterView) -> list[PrefillSide]:
        """The prefill workers worth pricing for this request, best first, ranked by when they would
        finish it (compute once per request: the terms are shared by every decode worker)."""
        sides = [prefill_side(request, view, w) for w in view.prefill_workers(request.model)]
        if len(sides) <= self.config.remote_candidates:
            return sides
        if self.config.remote_candidates == 1:
            return [min(sides, key=_FINISH_S)]
        return sorted(sides, key=_FINISH_S)[: self.config.remote_candidates]

    def choose(
        self,
        request: RequestSummary,
        view: ClusterView,
        decode: WorkerLoad,
        pool: Sequence[PrefillSide] | None = None,
        side: DecodeSide | None = None,
    ) -> SiteChoice:
        """The cheapest option meeting the SLO, else the cheapest; `pool` from `remote_pool`, `side`
        from `decode_side` (computed here when not given)."""
        if side is None:
            side = decode_side(request, view, decode)  # shared by the local and the remote options
        local = evaluate(request, view, decode, None, side)
        remote_allowed = decode.role is WorkerRole.DECODE
        pool = self.remote_pool(request, view) if pool is None and remote_allowed else (pool or [])
        if not remote_allowed or not pool:
            return SiteChoice(local, SiteReason.NO_PREFILL_WORKER, self._cost(request, local))
        if local.prefill_tokens < self.config.min_remote_tokens:
            return SiteChoice(local, SiteReason.SHORT_PROMPT, self._cost(request, local))
        options = [local, *(evaluate(request, view, decode, p.worker, side, p) for p in pool)]
        costs = [self._cost(request, p) for p in options]
        feasible = [i for i, p in enumerate(options) if p.meets(request)] or range(len(options))
        best = min(feasible, key=lambda i: costs[i])
        chosen = options[best]
        return SiteChoice(chosen, self._reason(request, chosen, options), costs[best])

    def _cost(self, request: RequestSummary, placement: Placement) -> float:
        cost = (request.waited_s + placement.ttft_s) * 1e3 / request.slo.ttft_ms
        if placement.is_local and placement.added_tpot_s > 0.0:
            running = placement.decode.decode_batch
            tpot_limit_s = placement.tpot_limit_ms(request) / 1e3
            cost += self.config.interference_weight * running * placement.added_tpot_s / tpot_limit_s
        return cost

    def _reason(self, request: RequestSummary, chosen: Placement, options: Sequence[Placement]) -> SiteReason:
        if not chosen.is_local:
            return SiteReason.REMOTE_CHEAPER
        prompt = request.num_prompt_tokens
        cached = prompt - chosen.prefill_tokens
        if cached >= self.config.cache_hit_fraction * prompt:
            return SiteReason.DECODE_CACHE_HIT
        remote = [p for p in options if not p.is_local]
        if remote and min(p.ttft_s for p in remote) > chosen.ttft_s and _backlogged(remote):
            return SiteReason.PREFILL_FLEET_BUSY
        return SiteReason.LOCAL_CHEAPER


_FINISH_S = attrgetter("finish_s")


def _backlogged(remote: Sequence[Placement]) -> bool:
    """Every remote option has a queue ahead of it (so the queue, not the hop, made local win)."""
    return all(p.prefill is not None and p.prefill.queued_prefill_requests > 0 for p in remote)
