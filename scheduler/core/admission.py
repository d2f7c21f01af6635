"""The admission queue: requests no worker can serve within SLO yet, by tier, fairly weighted.

Fairness is weighted fair queueing over one FIFO per tier: each tier's head carries a virtual
finish tag, 1/weight after the previous one, and the smallest tag goes next (ties to the heavier
tier). With weights 6:3:1, contended capacity goes 60/30/10 to enterprise/plus/free, yet free is
never starved outright as it would be under strict priority. A tier that was empty rejoins at the
current virtual time rather than its old, low tag, so an idle tier cannot bank credit and burst.
When a tier's head cannot be placed, lighter tiers wait too: capacity that frees up goes to
the heavier tier first, and the weights order the tiers that can all be placed. Without that a
free request, whose looser targets fit a busier cluster, would take the capacity an enterprise
request is waiting for, and enterprise would be served last exactly when it matters.

Each tier has a maximum wait, and by default a request also leaves when its own TTFT target has
passed: it can no longer count towards goodput, and holding it longer would take capacity from
requests that still can. Leaving the queue is not a refusal: a request whose wait ran out is served
where a worker can still make progress, and refused only when none can (core/progress.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from scheduler.types import RequestSummary, Tier


def _default_weights() -> dict[Tier, float]:
    return {Tier.ENTERPRISE: 6.0, Tier.PLUS: 3.0, Tier.FREE: 1.0}


def _default_max_queue_s() -> dict[Tier, float]:
    return {Tier.ENTERPRISE: 10.0, Tier.PLUS: 5.0, Tier.FREE: 2.0}


@dataclass(frozen=True)
class AdmissionConfig:
    tier_weights: Mapping[Tier, float] = field(default_factory=_default_weights)
    max_queue_s: Mapping[Tier, float] = field(default_factory=_default_max_queue_s)
    max_depth: int = 1024  # per tier; a full tier rejects new arrivals at once
    expire_at_ttft_target: bool = True  # False: wait the full tier maximum even past the TTFT target
    # When a request's wait runs out it is served where a worker can still make progress (a free slot
    # and KV room) rather than refused: a slow answer beats a 503 (core/progress.py). These tiers are
    # served so even where that pushes running requests past a TPOT target they meet; the others only
    # where it does not. `serve_when_expired=False`: every expired request is refused.
    serve_when_expired: bool = True
    serve_past_running_targets: frozenset[Tier] = frozenset({Tier.ENTERPRISE})

    def __post_init__(self) -> None:
        for name, table in (("tier_weights", self.tier_weights), ("max_queue_s", self.max_queue_s)):
            missing = [t.value for t in Tier if t not in table]
            if missing or any(v <= 0 for v in table.values()):
                raise ValueError(f"{name} needs a positive value for every tier; missing: {missing}")
        if self.max_depth <= 0:
            raise ValueError(f"max_depth must be positive, got {self.max_depth}")


@dataclass(frozen=True)
class QueuedRequest:
    request: RequestSummary
    enqueued_at: float
    deadline: float  # rejected if still queued after this


class AdmissionQueue:
    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self._fifo: dict[Tier, deque[QueuedRequest]] = {tier: deque() for tier in Tier}
        self._tag: dict[Tier, float] = dict.fromkeys(Tier, 0.0)  # finish tag of the tier's head
        self._virtual_time = 0.0  # tag of the last request served
        self._tier_of: dict[str, Tier] = {}

    def __len__(self) -> int:
        return len(self._tier_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tier_of

    def depth(self, tier: Tier) -> int:
        return len(self._fifo[tier])

    def push(self, request: RequestSummary, now: float) -> bool:
        """Queue at the tail of the request's tier; False when that tier is full."""
        fifo = self._fifo[request.tier]
        if len(fifo) >= self.config.max_depth or request.request_id in self._tier_of:
            return False
        if not fifo:
            weight = self.config.tier_weights[request.tier]
            self._tag[request.tier] = max(self._tag[request.tier], self._virtual_time) + 1.0 / weight
        limit = self.config.max_queue_s[request.tier]
        if self.config.expire_at_ttft_target:
            limit = min(limit, max(request.slo.ttft_ms / 1e3 - request.waited_s, 0.0))
        fifo.append(QueuedRequest(request, now, now + limit))
        self._tier_of[request.request_id] = request.tier
        return True

    def has_waiting_at_or_above(self, tier: Tier) -> bool:
        """Whether a request of this tier, or of one weighted at least as much, is waiting."""
        weight = self.config.tier_weights[tier]
        return any(fifo and self.config.tier_weights[t] >= weight for t, fifo in self._fifo.items())

    def tiers_not_above(self, tier: Tier) -> set[Tier]:
        """`tier` and every tier weighted no more than it."""
        weight = self.config.tier_weights[tier]
        return {t for t in Tier if self.config.tier_weights[t] <= weight}

    def peek(self, skip: Container[Tier] = ()) -> QueuedRequest | None:
        """The request fairness says goes next, among tiers not in `skip`."""
        tiers = [t for t, fifo in self._fifo.items() if fifo and t not in skip]
        if not tiers:
            return None
        tier = min(tiers, key=lambda t: (self._tag[t], -self.config.tier_weights[t]))
        return self._fifo[tier][0]

    def pop(self, tier: Tier) -> QueuedRequest:
        """Serve the head of `tier` (the one `peek` returned); the next head's tag moves 1/weight on."""
        fifo = self._fifo[tier]
        entry = fifo.popleft()
        del self._tier_of[entry.request.request_id]
        self._virtual_time = self._tag[tier]
        if fifo:
            self._tag[tier] += 1.0 / self.config.tier_weights[tier]
        return entry

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a request out without serving it (cancelled by the client)."""
        tier = self._tier_of.pop(request_id, None)
        if tier is None:
            return None
        fifo = self._fifo[tier]
        entry = next(e for e in fifo if e.request.request_id == request_id)
        fifo.remove(entry)
        return entry

    def pop_expired(self, now: float) -> list[QueuedRequest]:
        """Remove and return requests past their deadline (requests may carry their own SLOs, so
        deadlines within a tier need not be in FIFO order)."""
        expired: list[QueuedRequest] = []
        for tier, fifo in self._fifo.items():
            if not any(e.deadline < now for e in fifo):
                continue
            expired.extend(e for e in fifo if e.deadline < now)
            self._fifo[tier] = deque(e for e in fifo if e.deadline >= now)
        for entry in expired:
            del self._tier_of[entry.request.request_id]
        return expired
