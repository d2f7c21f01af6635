"""Discrete-event replay: the real scheduler core over a trace and simulated workers.

The `Scheduler` here is the same class the gRPC service runs; only the clock and the workers are
simulated. Workers heartbeat every `heartbeat_interval_s` (so the scheduler sees load as late as
it would in production), queued requests are retried every `tick_interval_s`, and each finished
request is reported through `on_finished`. Policies are therefore compared under the information
they would really have, in seconds of wall time.

    python -m scheduler.replay            # the built-in heterogeneous workload, every policy
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from scheduler.core.policies import POLICY_NAMES, Policy, make_policy
from scheduler.core.scheduler import Scheduler, SchedulerConfig
from scheduler.sim.gateway import NO_GATEWAY, GatewayCost, SimGateways
from scheduler.sim.results import ReplayResult, RequestOutcome
from scheduler.sim.sequence import SimSequence, StepOutcome
from scheduler.sim.spec import SimWorkerSpec
from scheduler.sim.trace import Arrival
from scheduler.sim.worker import SimWorker
from scheduler.types import SLO, DecisionKind, RequestSummary, RouteDecision, Tier


@dataclass(frozen=True)
class Clients:
    """Clients that give up: a request not answered in full `timeout_s` after it arrived is a client
    timeout (not served, as `baton bench --request-timeout` counts it), and the gateway aborts its
    generation `detach_grace_s` later (its stream detach grace), which frees the worker's queue place or
    blocks. Without them an overloaded worker's queue only grows: round-robin's exp3 replays in
    policy_compare put its TTFT p90 at ~3x the real one."""

    timeout_s: float
    detach_grace_s: float = 0.0


@dataclass(frozen=True)
class ReplayConfig:
    heartbeat_interval_s: float = 0.05
    tick_interval_s: float = 0.01
    step_noise: float = 0.05  # relative standard deviation of simulated step and transfer times
    seed: int = 0
    seed_profiles: bool = True  # scheduler starts from each worker's true profile, as `baton profile` gives
    drain_s: float = 600.0  # after the last arrival; anything unfinished by then is a miss
    # What a client's TTFT holds beyond the scheduler's view (the gateway before the route, the first
    # token's way out to the client); added to simulated TTFT and e2e, judged against the SLO.
    client_overhead_s: float = 0.0
    # The gateway's event loop as a queue that requests and streamed tokens wait in (scheduler/sim/gateway.py).
    gateway: GatewayCost = NO_GATEWAY
    clients: Clients | None = None  # None: clients wait for ever
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


class _Event(Enum):
    ARRIVAL = auto()
    ROUTE = auto()  # the gateway has done a request's admission work: it asks the scheduler
    STEP_DONE = auto()
    TRANSFER_DONE = auto()
    HEARTBEAT = auto()
    TICK = auto()
    CLIENT_GONE = auto()  # the client's timeout passed: the request counts as timed out
    ABORT = auto()  # the gateway aborts what the gone client left running


class ReplayRun:
    """One replay of a trace through the real scheduler core on simulated workers: construct, `run()`, then
    `result(policy_name)`. `replay()` is the usual way in; construct one directly to give each worker its own
    step noise (`noise`: worker id -> relative noise; a worker not in it gets `config.step_noise`). Every
    worker draws from one generator seeded with `config.seed`, so a run is a function of its inputs."""

    def __init__(
        self,
        trace: Sequence[Arrival],
        workers: Sequence[SimWorkerSpec],
        policy: Policy,
        slo_for: Callable[[Tier], SLO],
        config: ReplayConfig,
        noise: Mapping[str, float] | None = None,
    ) -> None:
        rng = random.Random(config.seed)
        noise = noise or {}
        self.config = config
        self.scheduler = Scheduler(policy, config.scheduler)
        self.workers = {w.worker_id: SimWorker(w, rng, noise.get(w.worker_id, config.step_noise)) for w in workers}
        self.gateways = SimGateways(config.gateway)
        self.trace = {a.request_id: a for a in trace}
        self.slo_for = slo_for
        self.outcomes: dict[str, RequestOutcome] = {}
        self.sequences: dict[str, SimSequence] = {}
        self.queued: set[str] = set()
        self._heap: list[tuple[float, int, _Event, Any]] = []
        self._order = itertools.count()  # ties broken by insertion order: deterministic runs
        self.now = 0.0

    def push(self, at: float, kind: _Event, payload: Any = None) -> None:
        heapq.heappush(self._heap, (at, next(self._order), kind, payload))

    def run(self) -> None:
        start = min((a.time_s for a in self.trace.values()), default=0.0)
        for index, worker in enumerate(self.workers.values()):
            snapshot, _, _ = worker.heartbeat(start)
            seed = worker.spec.scheduler_seed or worker.spec.profile
            profile = seed if self.config.seed_profiles else None
            self.scheduler.register(snapshot, start, profile)
            stagger = self.config.heartbeat_interval_s * index / max(len(self.workers), 1)
            self.push(start + stagger, _Event.HEARTBEAT, worker.worker_id)
        for arrival in self.trace.values():
            self.push(arrival.time_s, _Event.ARRIVAL, arrival)
        self.push(start, _Event.TICK)
        horizon = max((a.time_s for a in self.trace.values()), default=0.0) + self.config.drain_s
        handlers: dict[_Event, Callable[[Any], None]] = {
            _Event.ARRIVAL: self._on_arrival,
            _Event.ROUTE: self._on_route,
            _Event.STEP_DONE: self._on_step_done,
            _Event.TRANSFER_DONE: self._on_transfer_done,
            _Event.HEARTBEAT: self._on_heartbeat,
            _Event.TICK: self._on_tick,
            _Event.CLIENT_GONE: self._on_client_gone,
            _Event.ABORT: self._on_abort,
        }
        while self._heap and len(self.outcomes) < len(self.trace):
            self.now, _, kind, payload = heapq.heappop(self._heap)
            if self.now > horizon:
                break
            handlers[kind](payload)

    # ---- events --------------------------------------------------------------------------------

    def _on_arrival(self, arrival: Arrival) -> None:
        if self.config.clients is not None:
            self.push(arrival.time_s + self.config.clients.timeout_s, _Event.CLIENT_GONE, arrival)
        if self.config.gateway.free:
            self._on_route(arrival)
        else:
            self.push(self.gateways.of(arrival.request_id).admit(self.now), _Event.ROUTE, arrival)

    def _on_route(self, arrival: Arrival) -> None:
        request = RequestSummary(
            request_id=arrival.request_id,
            num_prompt_tokens=arrival.prompt_tokens,
            prefix_hashes=arrival.prefix_hashes,
            tier=arrival.tier,
            slo=self.slo_for(arrival.tier),
            max_tokens=arrival.effective_max_tokens,
            conversation_id=arrival.conversation_id,
        )
        self._apply(self.scheduler.route(request, self.now))

    def _on_tick(self, _: None) -> None:
        if self.scheduler.queued:
            for decision in self.scheduler.tick(self.now):
                self._apply(decision)
        self.push(self.now + self.config.tick_interval_s, _Event.TICK)

    def _on_heartbeat(self, worker_id: str) -> None:
        snapshot, samples, events = self.workers[worker_id].heartbeat(self.now)
        self.scheduler.on_heartbeat(snapshot, samples, events, self.now)
        self.push(self.now + self.config.heartbeat_interval_s, _Event.HEARTBEAT, worker_id)

    def _on_step_done(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        outcome: StepOutcome = worker.finish_step(self.now)
        self._stream(outcome)
        for job in outcome.prefilled:
            # The KV the decode worker lacks crosses the link; the first token is out when it lands.
            tokens = job.seq.arrival.prompt_tokens - job.seq.decode_cached_tokens
            self.push(self.now + worker.transfer_s(tokens), _Event.TRANSFER_DONE, job.seq)
        self._finish(outcome.finished)
        self._allocate(worker)
        self._kick(worker)

    def _on_transfer_done(self, seq: SimSequence) -> None:
        worker = self.workers[seq.decode_worker]
        done = worker.land(seq, self.now)
        if seq.first_token_at is not None:  # committed at once (no step in flight): its first token is out
            self._stream(StepOutcome(first_tokens=[seq], finished=[] if done is None else [done]))
        if done is not None:
            self._finish([done])
            self._allocate(worker)
        self._kick(worker)

    def _on_client_gone(self, arrival: Arrival) -> None:
        if arrival.request_id in self.outcomes:  # answered (or refused) in time
            return
        self._record(arrival, self.sequences.get(arrival.request_id), rejected=False, timed_out=True)
        assert self.config.clients is not None  # only they schedule this event
        self.push(self.now + self.config.clients.detach_grace_s, _Event.ABORT, arrival.request_id)

    def _on_abort(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None and seq.finished_at is not None:  # it finished during the grace
            return
        self.scheduler.on_finished(request_id, self.now)  # also takes it out of the admission queue
        if seq is None:
            return
        if seq.last_token_out_at is not None and seq.finished_out_at is None:  # its stream leaves the gateway
            self.gateways.of(request_id).close(max(seq.last_token_out_at, self.now))
        for worker_id in {seq.decode_worker, seq.prefill_worker or seq.decode_worker}:
            worker = self.workers[worker_id]
            worker.abort(seq)
            self._allocate(worker)
            self._kick(worker)

    # ---- helpers -------------------------------------------------------------------------------

    def _stream(self, outcome: StepOutcome) -> None:
        """A step's tokens through the gateway: when each stream's token is out to its client."""
        if self.config.gateway.free:
            for seq in outcome.first_tokens:
                seq.first_token_out_at = self.now
            for seq in outcome.finished:
                seq.finished_out_at = self.now
            return
        of = self.gateways.of
        for seq in outcome.streamed:
            if seq.last_token_out_at is not None:  # None: its first token never reached the gateway
                seq.last_token_out_at = of(seq.arrival.request_id).next_token(seq.last_token_out_at, self.now)
        for seq in outcome.first_tokens:
            seq.first_token_out_at = seq.last_token_out_at = of(seq.arrival.request_id).first_token(self.now)
        for seq in outcome.finished:
            seq.finished_out_at = seq.last_token_out_at
            if seq.finished_out_at is not None:
                of(seq.arrival.request_id).close(seq.finished_out_at)

    def _apply(self, decision: RouteDecision) -> None:
        arrival = self.trace[decision.request_id]
        if decision.kind is DecisionKind.QUEUE:
            self.queued.add(arrival.request_id)
            return
        if decision.kind is DecisionKind.REJECT:
            self._record(arrival, None, rejected=True)
            return
        assert decision.decode_worker_id is not None
        max_tokens = decision.max_tokens or arrival.effective_max_tokens
        seq = SimSequence(
            arrival=arrival,
            slo=self.slo_for(arrival.tier),
            output_tokens=min(arrival.output_tokens, max_tokens),
            max_tokens=max_tokens,
            decode_worker=decision.decode_worker_id,
            prefill_worker=decision.prefill_worker_id,
            admitted_at=self.now,
        )
        self.sequences[arrival.request_id] = seq
        worker = self.workers[seq.decode_worker]
        worker.admit(seq)
        if not worker.busy:
            # The engine takes a request between steps (an engine-thread command: a decode worker's
            # remote reservation waits for the step in flight, docs/benchmarks.md's hand-off phases);
            # mid-step, the step's end allocates it (`_on_step_done`).
            self._allocate(worker)
        self._kick(worker)

    def _allocate(self, worker: SimWorker) -> None:
        """Decode-first: a sequence's prefill starts only once its decode worker holds blocks for it."""
        for seq in worker.allocate_waiting():
            prefill = worker if seq.prefill_worker is None else self.workers[seq.prefill_worker]
            seq.prefill_queued_at = self.now
            prefill.enqueue_prefill(seq)
            self._kick(prefill)

    def _kick(self, worker: SimWorker) -> None:
        if not worker.busy:
            seconds = worker.start_step(self.now)
            if seconds is not None:
                self.push(self.now + seconds, _Event.STEP_DONE, worker.worker_id)

    def _finish(self, finished: list[SimSequence]) -> None:
        for seq in finished:
            self.scheduler.on_finished(seq.arrival.request_id, self.now)
            if seq.arrival.request_id not in self.outcomes:  # else its client had given up
                self._record(seq.arrival, seq, rejected=False)

    def _record(self, arrival: Arrival, seq: SimSequence | None, rejected: bool, timed_out: bool = False) -> None:
        ttft = tpot = e2e = None
        if not timed_out and seq is not None and seq.first_token_at is not None and seq.finished_at is not None:
            first = seq.first_token_out_at if seq.first_token_out_at is not None else seq.first_token_at
            last = seq.finished_out_at if seq.finished_out_at is not None else seq.finished_at
            ttft = first - arrival.time_s + self.config.client_overhead_s
            e2e = last - arrival.time_s + self.config.client_overhead_s
            tpot = (last - first) / max(seq.output_tokens - 1, 1)
        slo = self.slo_for(arrival.tier)
        met = (
            ttft is not None and tpot is not None and ttft * 1e3 <= slo.ttft_ms and tpot * 1e3 <= slo.tpot_ms
        )
        self.outcomes[arrival.request_id] = RequestOutcome(
            request_id=arrival.request_id,
            tier=arrival.tier,
            arrival_s=arrival.time_s,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            met_slo=met,
            rejected=rejected,
            degraded=seq is not None and seq.output_tokens < arrival.output_tokens,
            queued=arrival.request_id in self.queued,
            timed_out=timed_out,
            decode_worker_id=None if seq is None else seq.decode_worker,
            prefill_worker_id=None if seq is None else seq.prefill_worker,
            prefill_compute_s=_prefill_compute_s(seq),
            handoff_overhead_s=_handoff_overhead_s(seq),
        )

    def result(self, policy_name: str) -> ReplayResult:
        for arrival in self.trace.values():  # unfinished at the horizon: a miss, not served
            if arrival.request_id not in self.outcomes:
                self._record(arrival, self.sequences.get(arrival.request_id), rejected=False)
        start = min((a.time_s for a in self.trace.values()), default=0.0)
        ordered = tuple(self.outcomes[rid] for rid in self.trace)
        return ReplayResult(policy_name, ordered, self.now - start)


def _prefill_compute_s(seq: SimSequence | None) -> float | None:
    if seq is None or seq.prefill_worker is None or seq.prefill_started_at is None or seq.prefilled_at is None:
        return None
    return seq.prefilled_at - seq.prefill_started_at


def _handoff_overhead_s(seq: SimSequence | None) -> float | None:
    """Reservation asked -> first token, less the prefill worker's queue and compute: the decode
    worker's `overhead` phase (RPC, WRITE, notice, commit; here the step-boundary waits and the transfer)."""
    if _prefill_compute_s(seq) is None:
        return None
    assert seq is not None and seq.prefilled_at is not None
    if seq.admitted_at is None or seq.prefill_queued_at is None or seq.first_token_at is None:
        return None
    return (seq.first_token_at - seq.admitted_at) - (seq.prefilled_at - seq.prefill_queued_at)


def replay(
    trace: Sequence[Arrival],
    workers: Sequence[SimWorkerSpec],
    policy_name: str | Policy,
    slo: SLO | Mapping[Tier, SLO],
    config: ReplayConfig | None = None,
) -> ReplayResult:
    """Replay `trace` on simulated `workers` under a policy (a name from POLICY_NAMES, or an instance)."""
    policy = make_policy(policy_name) if isinstance(policy_name, str) else policy_name
    if isinstance(slo, SLO):
        single = slo
        slo_for: Callable[[Tier], SLO] = lambda _tier: single
    else:
        missing = [t.value for t in Tier if t not in slo]
        if missing:
            raise ValueError(f"slo mapping lacks tiers {missing}")
        slo_for = slo.__getitem__
    if len({w.worker_id for w in workers}) != len(workers):
        raise ValueError("worker ids must be unique")
    run = ReplayRun(trace, workers, policy, slo_for, config or ReplayConfig())
    run.run()
    return run.result(policy.name)


def main(argv: Sequence[str] | None = None) -> None:
    """Compare every policy on the built-in heterogeneous scenario at one or more arrival rates."""
    import argparse

    from scheduler.sim.scenarios import heterogeneous_cluster, heterogeneous_workload, tier_slos

    parser = argparse.ArgumentParser(prog="python -m scheduler.replay", description=main.__doc__)
    parser.add_argument("--rate", type=float, nargs="+", default=[20.0], help="arrivals per second")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=POLICY_NAMES, nargs="+", default=list(POLICY_NAMES))
    parser.add_argument(
        "--unprofiled", action="store_true", help="start cost models from defaults, learn from samples only"
    )
    args = parser.parse_args(argv)
    config = ReplayConfig(seed=args.seed, seed_profiles=not args.unprofiled)
    for rate in args.rate:
        trace = heterogeneous_workload(rate, args.requests, args.seed)
        print(f"rate {rate:g}/s, {len(trace)} requests")
        for name in args.policy:
            result = replay(trace, heterogeneous_cluster(), name, tier_slos(), config)
            print("  " + result.summary())


if __name__ == "__main__":
    main()
