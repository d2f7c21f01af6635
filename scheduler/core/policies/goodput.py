"""Place each request where its predicted TTFT and TPOT most likely meet its tier's SLO.

Goodput counts requests that meet both targets, so a placement that serves one request late is
worth nothing and one that pushes a worker's step time past the TPOT target of requests already
there costs several. The policy therefore:
1. predicts TTFT/TPOT on every decode worker, its prompt prefilled where `PrefillSiting` says
   is cheapest (a prefill worker, or the decode worker itself: core/prefill_site.py);
2. keeps candidates that fit in KV memory, meet the request's targets and keep the tightest TPOT
   target already on the decode worker, and, for a lighter tier, leave room somewhere for a
   heavier-tier request of the same size, room it would meet its targets in by at least one
   expected prediction error (trunk reservation, see `_leaves_room`: under overload free requests
   otherwise fill every batch, and enterprise, arriving later, is the one that waits); a
   conversation's later turn prefers the worker that
   served the previous one (its prefix is there), otherwise the candidate most likely to meet both
   targets wins: the most headroom in units of each prediction's expected error
   (`Placement.confidence`: a queue wait is far less certain than a computed step);
3. when no candidate qualifies, for a degradable tier: serve it on its model's smaller fallback
   model (`degrade_models`) if that fleet qualifies, else with a shorter max_tokens if configured
   and that qualifies;
   serve best-effort what waiting can't help (unattainable even on an idle worker, or TTFT
   already lost in the queue when the queue is set to keep such requests); otherwise QUEUE
   (the scheduler's admission queue retries with weighted tier fairness) or,
   with queueing off, REJECT with a retry_after estimated from the predicted TTFT overshoot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.placement import DecodeSide, Placement, PrefillSide, cached_tokens, decode_side, evaluate
from scheduler.core.policies.base import Policy, reject, reject_no_workers
from scheduler.core.prefill_site import PrefillSiting, SiteChoice
from scheduler.types import SLO, DecisionKind, Reason, RequestSummary, RouteDecision, Tier


@dataclass(frozen=True)
class GoodputConfig:
    queue_when_overloaded: bool = True  # False: reject at once with retry_after
    degrade_fraction: float | None = None  # e.g. 0.5: try half the max_tokens before queueing; None: off
    degrade_tiers: frozenset[Tier] = frozenset({Tier.FREE})  # only these tiers are ever degraded
    min_degraded_tokens: int = 16  # never degrade below this many output tokens
    # model -> its smaller fallback model, tried before a shorter max_tokens (same tokenizer: the
    # gateway has already tokenized the prompt). Empty: never switch models.
    degrade_models: Mapping[str, str] = field(default_factory=dict)
    serve_unattainable: bool = True  # route best-effort what waiting can't help (see module doc)
    # Decode workers fully priced per request, the most promising by a cheap score (`_shortlist`);
    # the conversation's previous worker is always priced too. 0: every worker.
    max_candidates: int = 8
    default_retry_after_s: float = 1.0
    max_retry_after_s: float = 30.0
    # A heavier tier keeps room reserved (trunk reservation, `_leaves_room`) only while one of its requests
    # arrived within this long: a tier that is absent reserves nothing. Several of its inter-arrival times
    # (the policy runs' enterprise requests came every ~3 s), short enough that one burst does not hold
    # lighter tiers back long after it.
    tier_memory_s: float = 30.0

    def __post_init__(self) -> None:
        if self.degrade_fraction is not None and not 0.0 < self.degrade_fraction < 1.0:
            raise ValueError(f"degrade_fraction must be in (0, 1) or None, got {self.degrade_fraction}")
        if any(not big or not small or big == small for big, small in self.degrade_models.items()):
            raise ValueError(f"degrade_models maps a model to a different one, got {dict(self.degrade_models)}")
        if self.max_candidates < 0:
            raise ValueError(f"max_candidates must be >= 0, got {self.max_candidates}")
        if not 0 < self.default_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < default_retry_after_s <= max_retry_after_s")
        if self.tier_memory_s <= 0:
            raise ValueError(f"tier_memory_s must be positive, got {self.tier_memory_s}")


class GoodputPolicy(Policy):
    name = "goodput"

    def __init__(self, config: GoodputConfig | None = None, siting: PrefillSiting | None = None) -> None:
        self.config = config or GoodputConfig()
        self._siting = siting or PrefillSiting()
        # Per tier, the tightest targets seen while it has been present, and when it was last seen (see
        # `_leaves_room`, `GoodputConfig.tier_memory_s`).
        self._tightest: dict[Tier, tuple[SLO, float]] = {}
        self._now = 0.0  # of the route call under way
        self._sites: dict[int, SiteChoice] = {}  # id(placement) -> its site choice, for one route call
        self._pool: list[PrefillSide] = []  # the request's ranked prefill workers, for one route call
        # id(decode load) -> (load, its DecodeSide) for the request last priced by `_candidates`: its
        # heavier-tier probe (`_best`) is the same request with other targets, and a DecodeSide does
        # not depend on the targets, so the probe reuses them.
        self._decode_sides: dict[int, tuple[WorkerLoad, DecodeSide]] = {}
        # id(load) -> (load, its request-independent score): a worker's load object is rebuilt by the
        # registry whenever it changes (heartbeat = new cost samples, or a placement), so it is the key.
        self._base_scores: dict[int, tuple[WorkerLoad, float]] = {}

    def route(self, request: RequestSummary, view: ClusterView, now: float) -> RouteDecision:
        self._now = now
        self._remember(request, now)
        self._sites = {}
        placements = self._candidates(request, view)
        if not placements:
            return reject_no_workers(request)
        best = self._best(request, view, placements)
        if best is not None:
            return self._decide(request, best, DecisionKind.ROUTE, self._reason(request, view, best))
        return self._overloaded(request, view, placements)

    def _candidates(self, request: RequestSummary, view: ClusterView) -> list[Placement]:
        """One placement per decode worker, its prefill sited by cost (core/prefill_site.py)."""
        pool = self._pool = self._siting.remote_pool(request, view)
        sides = self._decode_sides = {}
        placements = []
        for decode in self._shortlist(request, view):
            side = decode_side(request, view, decode)
            sides[id(decode)] = (decode, side)
            choice = self._siting.choose(request, view, decode, pool, side)
            self._sites[id(choice.placement)] = choice
            placements.append(choice.placement)
        return placements

    def _shortlist(self, request: RequestSummary, view: ClusterView) -> list[WorkerLoad]:
        """The decode workers worth pricing: all of them up to `max_candidates`, else those a cheap
        score (prefill queue + decode step, less the prefix it already holds) ranks first. Pricing
        every worker costs ~two placement evaluations each, too slow for 64 workers at 1,000
        requests/s (docs/benchmarks.md, scheduler decision latency)."""
        workers = view.decode_workers(request.model)
        limit = self.config.max_candidates
        if not limit or len(workers) <= limit:
            return workers
        matches = view.prefix_matches(request.prefix_hashes)
        if len(self._base_scores) > _MAX_CACHED_SCORES:
            self._base_scores.clear()
        scores = [self._score(request, view, w, matches.get(w.worker_id, 0)) for w in workers]
        shortlist = [workers[i] for i in sorted(range(len(workers)), key=scores.__getitem__)[:limit]]
        previous = view.conversation_worker(request.conversation_id)
        if previous is not None and previous not in {w.worker_id for w in shortlist}:
            shortlist += [w for w in workers if w.worker_id == previous]
        return shortlist

    def _score(self, request: RequestSummary, view: ClusterView, decode: WorkerLoad, cached_blocks: int) -> float:
        """Seconds, lower is better: a rough TTFT + TPOT without the per-site detail of `evaluate`;
        `cached_blocks`: of the prompt, on `decode`."""
        cached = self._base_scores.get(id(decode))
        if cached is None or cached[0] is not decode:
            cost = view.cost(decode.worker_id)
            step = cost.decode_step_s(decode.decode_batch + 1, decode.context_tokens)
            backlog = cost.prefill_backlog_s(decode.queued_prefill_tokens, decode.queued_prefill_requests)
            cached = self._base_scores[id(decode)] = (decode, backlog + step * (1.0 + decode.slot_queue))
        if not cached_blocks:
            return cached[1]
        hit = cached_tokens(request.num_prompt_tokens, cached_blocks, decode.block_size)
        return cached[1] - view.cost(decode.worker_id).prefill_marginal_s(hit)

    def _decide(
        self, request: RequestSummary, placement: Placement, kind: DecisionKind, reason: Reason,
        max_tokens: int | None = None,
    ) -> RouteDecision:
        decision = placement.decision(request, kind, reason, max_tokens)
        choice = self._sites.get(id(placement))
        return decision if choice is None else replace(decision, prefill_reason=choice.reason)

    def _best(
        self, request: RequestSummary, view: ClusterView, placements: Sequence[Placement]
    ) -> Placement | None:
        qualifying = [p for p in placements if p.meets(request)]
        probe = self._heavier_probe(request, self._now)
        if probe is not None and qualifying:
            workers = view.decode_workers(request.model)
            sites = _ProbeSites(self._siting, self._pool, self._decode_sides)  # same prompt: same terms
            open_now = _open_now(probe, view, workers, sites)
            qualifying = [p for p in qualifying if _leaves_room(request, probe, view, p, open_now, sites)]
        if not qualifying:
            return None
        return max(qualifying, key=lambda p: (self._affinity(request, view, p), p.confidence(request)))

    @staticmethod
    def _affinity(request: RequestSummary, view: ClusterView, placement: Placement) -> bool:
        """A later conversation turn prefers the worker that holds its earlier turns' KV. (Cached
        blocks elsewhere, e.g. a shared system prompt, already count through the predicted TTFT.)"""
        previous = view.conversation_worker(request.conversation_id)
        return previous is not None and previous == placement.decode.worker_id

    def _reason(self, request: RequestSummary, view: ClusterView, placement: Placement) -> Reason:
        if self._affinity(request, view, placement):
            return Reason.CONVERSATION_AFFINITY
        return Reason.MAX_SLACK

    def _overloaded(
        self, request: RequestSummary, view: ClusterView, placements: list[Placement]
    ) -> RouteDecision:
        degraded = self._degrade(request, view)
        if degraded is not None:
            return degraded
        best_effort = self._best_effort(request, view, placements)
        if best_effort is not None:
            return best_effort
        if self.config.queue_when_overloaded:
            return RouteDecision(
                request_id=request.request_id, kind=DecisionKind.QUEUE, reason=Reason.OVERLOADED
            )
        return reject(request, Reason.OVERLOADED, self._retry_after(request, placements))

    def _degrade(self, request: RequestSummary, view: ClusterView) -> RouteDecision | None:
        if request.tier not in self.config.degrade_tiers:
            return None
        return self._smaller_model(request, view) or self._fewer_tokens(request, view)

    def _smaller_model(self, request: RequestSummary, view: ClusterView) -> RouteDecision | None:
        """The request, whole, on its model's fallback fleet, if a placement there meets the SLO."""
        fallback = self.config.degrade_models.get(request.model)
        if fallback is None:
            return None
        smaller = replace(request, model=fallback)
        best = self._best(smaller, view, self._candidates(smaller, view))
        if best is None:
            return None
        return replace(self._decide(smaller, best, DecisionKind.DEGRADE, Reason.DEGRADED_MODEL), model=fallback)

    def _fewer_tokens(self, request: RequestSummary, view: ClusterView) -> RouteDecision | None:
        fraction = self.config.degrade_fraction
        if fraction is None:
            return None
        max_tokens = max(self.config.min_degraded_tokens, int(request.max_tokens * fraction))
        if max_tokens >= request.max_tokens:
            return None
        shorter = replace(request, max_tokens=max_tokens)
        best = self._best(shorter, view, self._candidates(shorter, view))
        if best is None:
            return None
        return self._decide(request, best, DecisionKind.DEGRADE, Reason.DEGRADED, max_tokens)

    def _best_effort(
        self, request: RequestSummary, view: ClusterView, placements: list[Placement]
    ) -> RouteDecision | None:
        """Serve now what waiting cannot help: a TTFT target already passed while queued (placed
        where it keeps every TPOT target), or one no idle worker could meet (the least-bad spot)."""
        if not self.config.serve_unattainable:
            return None
        fitting = [p for p in placements if p.fits]
        if request.waited_s * 1e3 >= request.slo.ttft_ms:
            keeps_tpot = [p for p in fitting if p.tpot_s * 1e3 <= p.tpot_limit_ms(request)]
            if not keeps_tpot:
                return None
            best = min(keeps_tpot, key=lambda p: p.ttft_s)
            return self._decide(request, best, DecisionKind.ROUTE, Reason.BEST_EFFORT)
        if fitting and not self._attainable(request, view, placements):
            least_bad = max(fitting, key=lambda p: p.slack(request))
            return self._decide(request, least_bad, DecisionKind.ROUTE, Reason.BEST_EFFORT)
        return None

    @staticmethod
    def _attainable(request: RequestSummary, view: ClusterView, placements: Sequence[Placement]) -> bool:
        """Whether some candidate would meet the SLO if its workers were idle (ignoring time waited)."""
        fresh = replace(request, waited_s=0.0)
        for placement in placements:
            prefill = None if placement.prefill is None else placement.prefill.idle()
            if evaluate(fresh, view, placement.decode.idle(), prefill).meets(fresh):
                return True
        return False

    def _remember(self, request: RequestSummary, now: float) -> None:
        slo = request.slo
        seen = self._tightest.get(request.tier)
        if seen is not None and self._present(seen, now):
            slo = SLO(ttft_ms=min(seen[0].ttft_ms, slo.ttft_ms), tpot_ms=min(seen[0].tpot_ms, slo.tpot_ms))
        self._tightest[request.tier] = (slo, now)

    def _present(self, seen: tuple[SLO, float], now: float) -> bool:
        return now - seen[1] <= self.config.tier_memory_s

    def _heavier_probe(self, request: RequestSummary, now: float) -> RequestSummary | None:
        """The request as a heavier tier would send it (same size, the tightest heavier targets
        seen), or None when no heavier tier is present (seen within `tier_memory_s`)."""
        heavier = [seen[0] for t in _TIER_ORDER[_TIER_ORDER.index(request.tier) + 1 :]
                   if (seen := self._tightest.get(t)) is not None and self._present(seen, now)]
        if not heavier:
            return None
        slo = SLO(ttft_ms=min(s.ttft_ms for s in heavier), tpot_ms=min(s.tpot_ms for s in heavier))
        return replace(request, request_id=f"{request.request_id}#probe", slo=slo, waited_s=0.0)

    def _retry_after(self, request: RequestSummary, placements: Sequence[Placement]) -> float:
        # The smallest predicted TTFT overshoot is roughly how long the best queue takes to drain.
        overshoot_s = min((request.waited_s + p.ttft_s) - request.slo.ttft_ms / 1e3 for p in placements)
        estimate = max(overshoot_s, self.config.default_retry_after_s)
        return min(estimate, self.config.max_retry_after_s)


_TIER_ORDER = (Tier.FREE, Tier.PLUS, Tier.ENTERPRISE)  # lightest first
# How sure the room kept for a heavier tier must be, in expected prediction errors
# (`Placement.confidence`). At 0 (the predicted targets just met) lighter requests filled the batching
# worker until an enterprise request would wait ~2 s for a slot against a 2.5 s TTFT target; the slot
# wait is a guess about the running sequences' remaining lives, and on the CPU policy runs enterprise
# TTFT p90 then overshot (2.1-3.9 s real for 1.7-2.5 s predicted; docs/benchmarks.md, scheduler policies).
RESERVED_CONFIDENCE = 1.0
_MAX_CACHED_SCORES = 4096


@dataclass(frozen=True)
class _ProbeSites:
    siting: PrefillSiting
    pool: list[PrefillSide]  # the probe's prefill workers, ranked once
    decode_sides: dict[int, tuple[WorkerLoad, DecodeSide]]  # priced for the request already (same shape)

    def priced_first(self, workers: Sequence[WorkerLoad]) -> list[WorkerLoad]:
        """`workers`, those whose DecodeSide is known first (which ones `_open_now` finds does not
        change any answer of `_leaves_room`, see there; it only saves pricing)."""
        known = [w for w in workers if id(w) in self.decode_sides]
        return known + [w for w in workers if id(w) not in self.decode_sides]

    def serves(self, probe: RequestSummary, view: ClusterView, decode: WorkerLoad) -> bool:
        """Whether the heavier-tier probe would meet its latency targets on `decode`, by at least
        `RESERVED_CONFIDENCE` expected errors. KV room is not reserved: a lighter request held back
        for blocks alone would idle capacity that nothing needs yet, and heavier requests already
        waiting get freed blocks first through the admission queue."""
        known = self.decode_sides.get(id(decode))
        side = known[1] if known is not None and known[0] is decode else None
        placement = self.siting.choose(probe, view, decode, self.pool, side).placement
        return placement.confidence(probe) >= RESERVED_CONFIDENCE


def _open_now(
    probe: RequestSummary, view: ClusterView, workers: Sequence[WorkerLoad], sites: _ProbeSites
) -> set[str]:
    """Decode workers that could serve the heavier probe now, scanned only until two are found:
    `_leaves_room` only asks whether one other than the candidate's exists, and two always answer
    that (this keeps a decision O(1) probes on an unloaded cluster instead of one per worker)."""
    found: set[str] = set()
    for decode in sites.priced_first(workers):
        if sites.serves(probe, view, decode):
            found.add(decode.worker_id)
            if len(found) == 2:
                break
    return found


def _leaves_room(
    request: RequestSummary,
    probe: RequestSummary,
    view: ClusterView,
    placement: Placement,
    open_now: set[str],
    sites: _ProbeSites,
) -> bool:
    """Trunk reservation for heavier tiers: a lighter request takes a placement only if a heavier
    request of the same size arriving next could still meet its targets somewhere (another worker
    that can serve it now, or this one with the lighter request added). Without it, under
    overload free requests (looser TPOT) fill every batch to where no enterprise request meets
    its TPOT, and enterprise, arriving later, is the one that waits and times out."""
    decode = placement.decode
    if open_now - {decode.worker_id}:
        return True
    if decode.worker_id not in open_now:
        return False  # it could not serve the heavier request before; adding load will not help
    local = placement.prefill is None
    loaded = replace(
        decode,
        decode_batch=decode.decode_batch + 1,
        context_tokens=decode.context_tokens + request.num_prompt_tokens + request.max_tokens // 2,
        queued_prefill_tokens=decode.queued_prefill_tokens + (placement.prefill_tokens if local else 0),
        queued_prefill_requests=decode.queued_prefill_requests + int(local),
        free_blocks=max(decode.free_blocks - placement.blocks_needed, 0),
        tightest_tpot_ms=min(decode.tightest_tpot_ms or request.slo.tpot_ms, request.slo.tpot_ms),
    )
    return sites.serves(probe, view, loaded)
