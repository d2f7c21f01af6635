"""The Scheduler gRPC service: protobuf in, the pure core in between, addresses out.

Concurrency: every handler and the tick loop run on one asyncio event loop and never await while
inside a core call, so the core sees the serialised callers it requires (core/scheduler.py) with
no lock. The clock is read once per call and handed to the core as `now`.

Queued requests: when the core answers QUEUE, the Route stream sends a QUEUE message and stays
open on a future keyed by the request id; `tick` (every `tick_interval_s`, and at once after
anything that may have freed capacity) resolves it with the core's later ROUTE/DEGRADE/REJECT.
Dangerous windows:
- a tick answers a request whose caller has already gone (deadline, cancel): the placement is
  released at once with `on_finished`, or it would hold reservations and a TPOT target;
- the caller goes while queued: the request leaves the core's queue before the handler ends;
- the caller goes before a placement is written: the placement is released the same way;
- the waiter is registered before the QUEUE message is written: a tick running during that write
  must find it, or it would take the answer for an abandoned request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc
from opentelemetry import trace

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from rpcgen.baton.v1 import worker_pb2
from scheduler.adapters.clock import Clock
from scheduler.adapters.convert import (
    InvalidMessageError,
    failure_from_proto,
    kv_event_from_proto,
    response_from_decision,
    role_from_proto,
    role_switch_to_proto,
    sample_from_proto,
    snapshot_from_status,
    status_from_snapshot,
    summary_from_proto,
)
from scheduler.adapters.metrics import SchedulerMetrics
from scheduler.adapters.profiles import ProfileBook
from scheduler.core.policies.base import reject
from scheduler.core.scheduler import Scheduler
from scheduler.types import DecisionKind, Reason, RequestSummary, RouteDecision, WorkerSnapshot

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class ServicerConfig:
    heartbeat_interval_s: float = 0.2  # told to workers; the core's timeout should span several
    tick_interval_s: float = 0.05
    # Added to a tier's maximum queue time before the handler answers a wait itself: the core's
    # tick normally rejects it first, this only bounds the wait if the tick loop is stuck.
    queue_wait_margin_s: float = 0.5

    def __post_init__(self) -> None:
        if min(self.heartbeat_interval_s, self.tick_interval_s) <= 0 or self.queue_wait_margin_s < 0:
            raise ValueError("need heartbeat_interval_s > 0, tick_interval_s > 0, queue_wait_margin_s >= 0")


class _WaitEnded(Exception):
    """A queued Route ended without a decision: `Finished` for it, or the service shutting down."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        clock: Clock,
        metrics: SchedulerMetrics,
        profiles: ProfileBook | None = None,
        config: ServicerConfig | None = None,
    ) -> None:
        self._core = scheduler
        self._clock = clock
        self._metrics = metrics
        self._profiles = profiles or ProfileBook()
        self.config = config or ServicerConfig()
        # Latest snapshot of every worker the core holds (a superset until the next tick prunes):
        # addresses for responses, and the last view for ListWorkers.
        self._workers: dict[str, WorkerSnapshot] = {}
        self._waiters: dict[str, asyncio.Future[RouteDecision]] = {}
        self._wake = asyncio.Event()

    # ---- workers -------------------------------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        status = worker_pb2.WorkerStatus()
        status.CopyFrom(request.status)
        worker_id = request.worker_id or status.worker_id
        if status.worker_id and status.worker_id != worker_id:
            await _abort(context, f"worker_id {worker_id!r} differs from status.worker_id {status.worker_id!r}")
        status.worker_id = worker_id
        now = self._clock.now()
        snapshot = await _converted(context, lambda: snapshot_from_status(status, request.address, now))
        self._core.register(snapshot, now, self._profiles.for_model(snapshot.model))
        self._workers[worker_id] = snapshot
        self._metrics.registrations.inc()
        self._capacity_changed()
        log.info("registered %s (%s, %s) at %s", worker_id, snapshot.role.value, snapshot.model, snapshot.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.config.heartbeat_interval_s)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        now = self._clock.now()
        worker_id = request.status.worker_id
        # A worker the core dropped (or that registered with a previous scheduler process) must
        # register again: its cache is re-announced from scratch and its address is learnt anew.
        if worker_id not in self._workers or worker_id not in self._core.live_worker_ids(now):
            self._metrics.heartbeats.labels("unknown").inc()
            return pb.HeartbeatResponse(known=False)
        address = self._workers[worker_id].address
        try:
            snapshot = snapshot_from_status(request.status, address, now)
            samples = [sample_from_proto(s) for s in request.samples]
            events = [kv_event_from_proto(e) for e in request.kv_events]
        except InvalidMessageError as e:
            self._metrics.heartbeats.labels("invalid").inc()
            await _abort(context, str(e))
        if self._core.is_failed(worker_id):
            log.warning("worker %s heartbeats again after a failure report; routable", worker_id)
            self._metrics.failures_cleared.inc()
        self._core.on_heartbeat(snapshot, samples, events, now)
        self._workers[worker_id] = snapshot
        self._metrics.heartbeats.labels("applied").inc()
        self._capacity_changed()
        role = self._core.pending_role(worker_id)
        return pb.HeartbeatResponse(known=True, switch_to_role=role.value if role is not None else "")

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        routable = self._core.routable_worker_ids(self._clock.now())
        workers = [self._workers[w] for w in routable if w in self._workers]
        switches = {s.worker_id: role_switch_to_proto(s) for s in self._core.role_switches()}
        return pb.ListWorkersResponse(
            workers=[
                pb.LiveWorker(address=s.address, status=status_from_snapshot(s), role_switch=switches.get(s.worker_id))
                for s in workers
            ]
        )

    async def SetRole(self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext) -> pb.SetRoleResponse:
        role = await _converted(context, lambda: role_from_proto(request.role))
        try:
            switch = self._core.set_role(request.worker_id, role, self._clock.now())
        except KeyError:
            await _abort(context, f"no live worker {request.worker_id!r}", grpc.StatusCode.NOT_FOUND)
        log.warning("role switch of %s: %s -> %s (%s)", switch.worker_id, switch.from_role.value,
                    switch.to_role.value, switch.state.value)
        self._metrics.role_switches.labels(switch.to_role.value).inc()
        return pb.SetRoleResponse(role_switch=role_switch_to_proto(switch))

    async def ReportWorkerFailure(
        self, request: pb.ReportWorkerFailureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportWorkerFailureResponse:
        """A gateway lost the worker at `worker_address`: unroutable (and unlisted) until it heartbeats."""
        reason = await _converted(context, lambda: failure_from_proto(request))
        now = self._clock.now()
        ids = [w for w, s in self._workers.items() if s.address == request.worker_address]
        marked = [w for w in ids if self._core.report_failure(w, now)]
        self._metrics.failure_reports.labels(reason.value, "marked" if marked else "unknown").inc()
        if marked:
            log.warning("worker %s at %s reported failed (%s: %s); not routed to until it heartbeats",
                        ", ".join(marked), request.worker_address, reason.value, request.detail)
        return pb.ReportWorkerFailureResponse(known=bool(marked))

    # ---- requests ------------------------------------------------------------------------------

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes the final decision, preceded by a QUEUE message when the request must wait."""
        summary = await _converted(context, lambda: summary_from_proto(request))
        if summary.request_id in self._waiters:
            await _abort(context, f"request {summary.request_id} is already queued", grpc.StatusCode.ALREADY_EXISTS)
        decision = self._core.route(summary, self._clock.now())
        self._metrics.observe_decision(decision)
        trace.get_current_span().set_attributes(
            {"baton.request_id": summary.request_id, "baton.route.kind": decision.kind.value,
             "baton.route.reason": str(decision.reason or "")})
        if decision.kind is DecisionKind.QUEUE:
            self._metrics.queue_depth.set(self._core.queued)
            try:
                decision = await self._wait_queued(summary, decision, context)
            except _WaitEnded as e:
                await context.abort(e.code, str(e))
        if decision.is_placed:
            self._metrics.observe_slack(decision, summary.slo.ttft_ms, self._fleet_of(decision))
        try:
            await context.write(response_from_decision(decision, self._workers, summary.max_tokens))
        except BaseException:
            if decision.is_placed:  # never delivered: the request will not run, release its hold
                self._core.on_finished(summary.request_id, self._clock.now())
            raise

    async def Finished(self, request: pb.FinishedRequest, context: grpc.aio.ServicerContext) -> pb.FinishedResponse:
        self._core.on_finished(request.request_id, self._clock.now())
        waiter = self._waiters.pop(request.request_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(_WaitEnded(grpc.StatusCode.CANCELLED, "request finished while queued"))
        self._capacity_changed()
        return pb.FinishedResponse()

    async def _wait_queued(
        self, summary: RequestSummary, queued: RouteDecision, context: grpc.aio.ServicerContext
    ) -> RouteDecision:
        request_id = summary.request_id
        waiter: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter  # before any await: see the module docstring
        started = self._clock.now()
        limit_s = self._core.config.admission.max_queue_s[summary.tier] + self.config.queue_wait_margin_s
        try:
            # The caller's short liveness deadline covers the time to this message, not the wait.
            await context.write(response_from_decision(queued, self._workers, summary.max_tokens))
            async with asyncio.timeout(limit_s):
                return await waiter
        except TimeoutError:
            self._core.on_finished(request_id, self._clock.now())
            decision = reject(summary, Reason.QUEUE_TIMEOUT, self._core.retry_after_s(summary, self._clock.now()))
            self._metrics.observe_decision(decision)
            return decision
        except asyncio.CancelledError:
            self._core.on_finished(request_id, self._clock.now())  # the caller is gone
            raise
        finally:
            self._waiters.pop(request_id, None)
            self._metrics.queue_wait.observe(self._clock.now() - started)

    # ---- the tick loop -------------------------------------------------------------------------

    def tick(self) -> None:
        """Answer queued requests the core has placed or expired, and drop dead workers' state."""
        now = self._clock.now()
        for decision in self._core.tick(now):
            self._metrics.observe_decision(decision)
            waiter = self._waiters.pop(decision.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(decision)
            elif decision.is_placed:
                self._core.on_finished(decision.request_id, now)  # its caller is gone
        live = set(self._core.live_worker_ids(now))
        dead = [w for w in self._workers if w not in live]
        for worker_id in dead:
            log.warning("worker %s missed its heartbeat deadline; dropped", worker_id)
            del self._workers[worker_id]
        self._metrics.workers_expired.inc(len(dead))
        self._metrics.set_workers(list(self._workers.values()))
        self._metrics.set_fleets(self._core.fleet_signals(now), len(self._core.role_switches()))
        self._metrics.queue_depth.set(self._core.queued)

    async def run_ticks(self) -> None:
        """Tick until cancelled; a failing tick is logged, not fatal (the next one retries)."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self.tick()
            except Exception:
                log.exception("scheduler tick failed")

    def end_waits(self, details: str) -> None:
        """Answer every queued Route with UNAVAILABLE (shutdown): callers fall back at once."""
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(_WaitEnded(grpc.StatusCode.UNAVAILABLE, details))
        self._waiters.clear()

    def _fleet_of(self, decision: RouteDecision) -> str:
        """The fleet whose queue sets the decision's TTFT: the prefill worker's, else the decode worker's."""
        worker_id = decision.prefill_worker_id or decision.decode_worker_id
        snapshot = self._workers.get(worker_id or "")
        return snapshot.role.value if snapshot is not None else "unknown"

    def _capacity_changed(self) -> None:
        # Only queued requests care; waking for nothing would just spin the loop.
        if self._core.queued:
            self._wake.set()


async def _abort(
    context: grpc.aio.ServicerContext, details: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it always raises; this tells the type checker


async def _converted(context: grpc.aio.ServicerContext, convert: Callable[[], _T]) -> _T:
    try:
        return convert()
    except InvalidMessageError as e:
        await _abort(context, str(e))

