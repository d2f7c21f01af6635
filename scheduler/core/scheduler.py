"""The scheduler core: worker registry, cost models, prefix index, admission queue and one policy.

Pure and single-threaded: every method takes `now` from its caller and returns plain data, so the
gRPC adapter (wall clock, one asyncio loop) and the replay simulator (simulated clock) drive the
same object. Callers must serialise calls; nothing here locks.

The lifecycle of a request: `route` answers ROUTE/DEGRADE (placed), REJECT, or QUEUE; a queued
request is answered later by a `tick` (placed, or rejected when its tier's maximum wait passes);
`on_finished` releases what the request held, and also cancels it if it is still queued.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from mypy_extensions import mypyc_attr

from scheduler.core.admission import AdmissionConfig, AdmissionQueue
from scheduler.core.cluster_view import ClusterView, WorkerLoad
from scheduler.core.cost_model import CostModel, WorkerProfile
from scheduler.core.fleet_signals import FleetSignal, fleet_signals
from scheduler.core.placement import cached_tokens
from scheduler.core.policies.base import Policy, reject
from scheduler.core.prefix_index import PrefixIndex
from scheduler.core.progress import capacity_eta_s, progress_decision
from scheduler.core.registry import RateWindow, Reservation, WorkerRegistry
from scheduler.core.role_switch import RoleSwitches
from scheduler.types import (
    DecisionKind,
    KVEvent,
    MixedSample,
    Reason,
    RequestSummary,
    RoleSwitch,
    RouteDecision,
    StepSample,
    Tier,
    WorkerRole,
    WorkerSnapshot,
)


@dataclass(frozen=True)
class SchedulerConfig:
    heartbeat_timeout_s: float = 10.0  # silent this long: dead, never routed to again (adapters/server.py: why 10)
    # See registry: how long a placement may be missing from the heartbeats of a worker that does not
    # count the requests it takes on; and how long one is kept, at most, for a request that never arrives.
    dispatch_grace_s: float = 0.05
    dispatch_timeout_s: float = 5.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    default_profile: WorkerProfile = field(default_factory=WorkerProfile)  # for unprofiled workers
    cost_window: int = 512  # samples per fit: the last few seconds of steps
    max_conversations: int = 100_000  # conversation -> worker entries kept (LRU)
    # Placements' prefill compute is averaged over about this long to forecast the prefills a decoding
    # request will share its worker with (prefill_load.py): a few request lifetimes; and over at
    # least `prefill_min_window_s` at the start of a busy period.
    prefill_window_s: float = 10.0
    prefill_min_window_s: float = 2.0


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (scheduler/native.py), subclassed by the load tests' tap
class Scheduler:
    def __init__(self, policy: Policy, config: SchedulerConfig | None = None) -> None:
        self.policy = policy
        self.config = config or SchedulerConfig()
        window = RateWindow(self.config.prefill_window_s, self.config.prefill_min_window_s)
        self._registry = WorkerRegistry(self.config.heartbeat_timeout_s, self.config.dispatch_grace_s, window,
                                        self.config.dispatch_timeout_s)
        self._queue = AdmissionQueue(self.config.admission)
        self._prefix = PrefixIndex()
        self._costs: dict[str, CostModel] = {}
        self._pools: dict[str, CostModel] = {}  # model -> every worker's samples of it (cost_model.py: cold start)
        self._profiles: dict[str, WorkerProfile] = {}
        self._conversations: OrderedDict[str, str] = OrderedDict()
        self._switches = RoleSwitches()  # workers being drained for a role change: not routable
        # Bumped whenever the cluster could have gained capacity or the queue changed. A queued
        # request that could not be placed can only fare worse later with nothing new (its TTFT
        # budget shrinks), so `tick` retries placements only when this moved.
        self._version = 0
        self._tick_version = -1

    # ---- workers -------------------------------------------------------------------------------

    def register(self, snapshot: WorkerSnapshot, now: float, profile: WorkerProfile | None = None) -> None:
        """Add (or restart) a worker; its cost model starts from `profile` or the default one."""
        worker_id = snapshot.worker_id
        if profile is not None:
            self._profiles[worker_id] = profile
        self._prefix.drop_worker(worker_id)  # a (re)registering worker starts with an empty cache
        self._costs[worker_id] = self._new_cost_model(snapshot)
        self._registry.update(snapshot, now)
        self._switches.observe(snapshot, self._registry.holds_work(worker_id))
        self._version += 1

    def on_heartbeat(
        self,
        snapshot: WorkerSnapshot,
        samples: Iterable[StepSample],
        kv_events: Iterable[KVEvent],
        now: float,
    ) -> None:
        """A worker's periodic report; an unknown worker is registered with the default profile."""
        worker_id = snapshot.worker_id
        if self._registry.update(snapshot, now):
            self._prefix.drop_worker(worker_id)
            self._costs[worker_id] = self._new_cost_model(snapshot)
        cost, pool = self._costs[worker_id], self._pool(snapshot.model, worker_id)
        steps = tuple(samples)
        for sample in steps:
            cost.observe(sample)
            pool.observe(sample)
        cost.refit()  # here, off the routing path (docs/benchmarks.md, decision latency)
        pool.refit()
        for sample in steps:  # priced by the decode fit that includes this heartbeat's decode steps
            if isinstance(sample, MixedSample):
                excess = sample.seconds - cost.decode_step_s(sample.batch_size, sample.context_tokens)
                self._registry.record_folded(worker_id, excess, now)
        self._prefix.apply(worker_id, kv_events)
        self._switches.observe(snapshot, self._registry.holds_work(worker_id))
        self._version += 1

    def live_worker_ids(self, now: float) -> list[str]:
        self._expire(now)
        return self._registry.worker_ids()

    def report_failure(self, worker_id: str, now: float) -> bool:
        """A gateway lost the worker mid-request: route nothing there until it heartbeats again
        (registry.py: why a heartbeat clears it). False when the worker is not live."""
        self._expire(now)
        if worker_id not in self._registry:
            return False
        self._registry.mark_failed(worker_id)
        return True

    def is_failed(self, worker_id: str) -> bool:
        """Reported failed since its last heartbeat (unroutable, not listed)."""
        return self._registry.is_failed(worker_id)

    def routable_worker_ids(self, now: float) -> list[str]:
        """Live workers not reported failed since their last heartbeat (draining ones included)."""
        return [w for w in self.live_worker_ids(now) if not self._registry.is_failed(w)]

    def cost_model(self, worker_id: str) -> CostModel:
        return self._costs[worker_id]

    # ---- role switching (core/role_switch.py) ----------------------------------------------------

    def set_role(self, worker_id: str, role: WorkerRole, now: float) -> RoleSwitch:
        """Drain a live worker and switch it to `role`; KeyError when it is not live."""
        self._expire(now)
        if worker_id not in self._registry:
            raise KeyError(worker_id)
        switch = self._switches.start(self._registry.snapshot(worker_id), role)
        self._switches.observe(self._registry.snapshot(worker_id), self._registry.holds_work(worker_id))
        self._version += 1
        return self._switches.get(worker_id) or switch

    def pending_role(self, worker_id: str) -> WorkerRole | None:
        """The role a drained worker must take now (told in its heartbeat answer), if any."""
        return self._switches.pending(worker_id)

    def role_switches(self) -> list[RoleSwitch]:
        return self._switches.all()

    def worker_loads(self, now: float) -> list[WorkerLoad]:
        """Every live worker's load as the next decision would see it (reported + reserved since)."""
        self._expire(now)
        return self._registry.loads(now)

    def fleet_signals(self, now: float) -> list[FleetSignal]:
        """Per-role load signals for autoscaling (core/fleet_signals.py)."""
        self._expire(now)
        return fleet_signals(self._registry.loads(now), self._costs)

    # ---- requests ------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    def route(self, request: RequestSummary, now: float) -> RouteDecision:
        self._expire(now)
        if not self._queue and self._registry.idle(now):
            self._registry.restart_rates(now)  # a busy period begins: forecast it from itself
        view = self._view(now)
        too_large = _reject_if_too_large(request, view)
        if too_large is not None:
            return too_large
        # FIFO within a tier, and no overtaking a heavier tier: a newcomer waits behind them.
        if self._queue.has_waiting_at_or_above(request.tier):
            return self._enqueue(request, now, Reason.BEHIND_QUEUE)
        decision = self.policy.route(request, view, now)
        if decision.kind is DecisionKind.QUEUE:
            return self._enqueue(request, now, decision.reason)
        if decision.is_placed:
            self._commit(request, decision, now)
        return decision

    def tick(self, now: float) -> list[RouteDecision]:
        """Answers for queued requests: placed ones, and rejections for those waiting too long."""
        self._expire(now)
        expired = self._queue.pop_expired(now)
        if expired:
            self._version += 1  # new heads of line have not been tried yet
        decisions = [self._past_wait(entry.request, entry.enqueued_at, now) for entry in expired]
        if self._version == self._tick_version:
            return decisions
        self._tick_version = self._version
        blocked: set[Tier] = set()  # tiers that wait this round (see admission: FIFO, heavier first)
        while (entry := self._queue.peek(skip=blocked)) is not None:
            request = replace(entry.request, waited_s=now - entry.enqueued_at)
            decision = self.policy.route(request, self._view(now), now)
            if decision.kind is DecisionKind.QUEUE:
                blocked |= self._queue.tiers_not_above(request.tier)
                continue
            self._queue.pop(request.tier)
            if decision.is_placed:
                self._commit(request, decision, now)
            decisions.append(decision)
        return decisions

    def retry_after_s(self, request: RequestSummary, now: float) -> float:
        """When capacity for `request` is forecast back (core/progress.py): the Retry-After of a refusal."""
        self._expire(now)
        return capacity_eta_s(request, self._view(now))

    def on_finished(self, request_id: str, now: float) -> None:
        """The request finished, failed or was cancelled: release its hold on the cluster."""
        self._queue.remove(request_id)
        self._registry.untrack(request_id)
        self._version += 1

    # ---- internals -----------------------------------------------------------------------------

    def _new_cost_model(self, snapshot: WorkerSnapshot) -> CostModel:
        profile = self._profiles.get(snapshot.worker_id, self.config.default_profile)
        return CostModel(profile, window=self.config.cost_window, pool=self._pool(snapshot.model, snapshot.worker_id))

    def _pool(self, model: str, worker_id: str) -> CostModel:
        """The model's pooled fit, started from the profile of the first worker seen serving it."""
        pool = self._pools.get(model)
        if pool is None:
            profile = self._profiles.get(worker_id, self.config.default_profile)
            pool = self._pools[model] = CostModel(profile, window=self.config.cost_window)
        return pool

    def _expire(self, now: float) -> None:
        for worker_id in self._registry.expire(now):
            self._prefix.drop_worker(worker_id)
            self._costs.pop(worker_id, None)
            self._switches.forget(worker_id)
            self._version += 1

    def _view(self, now: float) -> ClusterView:
        loads = self._registry.routable_loads(now, self._switches.worker_ids())
        return ClusterView(loads, self._costs, self._prefix, self._conversations)

    def _past_wait(self, request: RequestSummary, enqueued_at: float, now: float) -> RouteDecision:
        """A queued request whose wait ran out: served where a worker can make progress (core/progress.py,
        `AdmissionConfig.serve_when_expired`), else refused until capacity is forecast back."""
        view = self._view(now)
        admission = self.config.admission
        if admission.serve_when_expired:
            waited = replace(request, waited_s=request.waited_s + now - enqueued_at)
            served = progress_decision(waited, view, request.tier in admission.serve_past_running_targets)
            if served is not None:
                self._commit(waited, served[0], now)
                return served[0]
        return reject(request, Reason.QUEUE_TIMEOUT, capacity_eta_s(request, view))

    def _enqueue(self, request: RequestSummary, now: float, reason: Reason | None) -> RouteDecision:
        if not self._queue.push(request, now):
            return reject(request, Reason.QUEUE_FULL, capacity_eta_s(request, self._view(now)))
        self._version += 1  # a request queued behind others has not been tried yet
        return RouteDecision(request_id=request.request_id, kind=DecisionKind.QUEUE, reason=reason)

    def _commit(self, request: RequestSummary, decision: RouteDecision, now: float) -> None:
        """Charge the placement to its workers until heartbeats show it, and remember it."""
        assert decision.decode_worker_id is not None  # placed decisions always name one
        decode_id, prefill_id = decision.decode_worker_id, decision.prefill_worker_id
        max_tokens = decision.max_tokens or request.max_tokens
        prompt, choices = request.num_prompt_tokens, request.num_choices
        block_size = self._registry.snapshot(decode_id).block_size
        blocks = math.ceil((prompt + max_tokens * choices) / block_size) - decision.cached_blocks
        decode_share = Reservation(
            decode_seqs=choices, context_tokens=(prompt + max_tokens // 2) * choices, blocks=max(blocks, 0)
        )
        prefill_id = prefill_id or decode_id
        prefill_cached = self._prefix.match(prefill_id, request.prefix_hashes)
        prefill_cached_tokens = cached_tokens(
            prompt, prefill_cached, self._registry.snapshot(prefill_id).block_size
        )
        new_tokens = prompt - prefill_cached_tokens
        prefill_share = Reservation(prefill_tokens=new_tokens, prefill_requests=1)
        # One reservation per request and worker: a worker's heartbeat counts requests (registry.py).
        if prefill_id == decode_id:
            self._registry.reserve(decode_id, decode_share.plus(prefill_share), now)
        else:
            self._registry.reserve(decode_id, decode_share, now)
            self._registry.reserve(prefill_id, prefill_share, now)
        compute_s = self._costs[prefill_id].prefill_s(new_tokens, prefill_cached_tokens)
        self._registry.record_prefill(prefill_id, compute_s, new_tokens, now)
        self._registry.track(request.request_id, decode_id, request.slo.tpot_ms, now)
        if request.conversation_id is not None:
            self._conversations[request.conversation_id] = decode_id
            self._conversations.move_to_end(request.conversation_id)
            if len(self._conversations) > self.config.max_conversations:
                self._conversations.popitem(last=False)


def _reject_if_too_large(request: RequestSummary, view: ClusterView) -> RouteDecision | None:
    """Reject what no decode worker could ever hold; retrying would not help."""
    workers = view.decode_workers(request.model)
    if not workers:
        return None  # the policy answers NO_WORKERS with a retry hint
    tokens = request.num_prompt_tokens + request.output_tokens
    if any(math.ceil(tokens / w.block_size) <= w.snapshot.total_blocks for w in workers):
        return None
    return reject(request, Reason.TOO_LARGE, None)
