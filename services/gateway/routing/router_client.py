"""Where a request goes, seen from the gateway: ask the scheduler, and keep routing without it.

`RouterClient.route(summary)` answers a `RoutingDecision` (plain data: worker addresses, never
protobuf) from one of three sources:
- SCHEDULER: the scheduler's Route answer. A queued request's answer may take up to its tier's
  maximum queue time, but the scheduler must answer or say QUEUE within `call_timeout_s`
  (~200 ms) or it counts as unreachable.
- LAST_VIEW: the scheduler is unreachable (refused, timed out, failing). The client routes over
  the live workers it last listed (refreshed every `view_refresh_s` while the scheduler is up):
  the least loaded decode worker, counting what this client sent there since, ties in turn. After
  a failure it routes from the view for `retry_scheduler_after_s` before asking again, so an
  outage costs one probe per interval rather than one timeout per request, and recovery is
  automatic once the scheduler answers (any answer, also one to a call made before the failure:
  a single late answer is not an outage).
- STATIC: no scheduler configured: round-robin over `StaticWorkers.decode`, prefill on a static
  prefill worker for long prompts, else locally. With a scheduler configured, the static workers
  are the view until the first list arrives.

A worker the gateway found dead (`report_lost`, from a lost Generate stream) is avoided for
`suspect_s`: local routing skips it, and a scheduler answer that names it is released and replaced by a
last-view route without it. The loss is also reported to the scheduler (`ReportWorkerFailure`, once per
suspect period), which stops routing there for every gateway until the worker heartbeats again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import grpc

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler.types import Reason, RequestSummary, WorkerFailure
from services.common.cluster_auth import ClusterToken, internal_channel
from services.common.errors import BatonError
from services.gateway.routing.convert import failure_report_to_proto, reason_from_proto, summary_to_proto
from services.gateway.routing.last_view import StaticWorkers, known_worker, static_view

log = logging.getLogger(__name__)

# Short reconnect backoff: gRPC's default grows to 120 s, which would keep a gateway on its last
# view for minutes after the scheduler came back.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# The scheduler said something is wrong with the request itself: routing elsewhere won't fix it.
_CALLER_ERRORS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)
NO_VIEW_RETRY_AFTER_S = 1.0
_T = TypeVar("_T")


class _NoAnswer(Exception):
    """The scheduler closed a Route stream without a decision (counts as a failing scheduler)."""


class RouteKind(StrEnum):
    ROUTE = "route"
    DEGRADE = "degrade"  # placed, with the lower `max_tokens` in the decision
    REJECT = "reject"


class RouteSource(StrEnum):
    SCHEDULER = "scheduler"
    LAST_VIEW = "last_view"
    STATIC = "static"


class RoutingError(BatonError):
    """The scheduler refused the request as malformed (a gateway bug, not an overload)."""

    code = "routing_error"


@dataclass(frozen=True)
class RoutingDecision:
    request_id: str
    kind: RouteKind
    source: RouteSource
    decode_address: str | None = None
    prefill_address: str | None = None  # None with a decode address: prefill on the decode worker
    max_tokens: int | None = None  # placed: the cap to apply (lower than asked when degraded)
    reason: Reason | None = None  # the scheduler's; None when it gave none, or the gateway routed itself
    retry_after_s: float | None = None  # REJECT: when a retry may help; None: it won't
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    cached_blocks: int = 0
    model: str = ""  # placed: the model serving it when not the asked one (degraded to a fallback)

    @property
    def is_placed(self) -> bool:
        return self.kind is not RouteKind.REJECT


@dataclass(frozen=True)
class RouterConfig:
    call_timeout_s: float = 0.2  # to an answer or "queued"; longer counts as unreachable
    max_queue_wait_s: float = 11.0  # the scheduler's longest tier wait (10 s) plus its margin
    view_refresh_s: float = 1.0
    retry_scheduler_after_s: float = 0.5
    min_remote_prefill_tokens: int = 256  # shorter prompts prefill locally without the scheduler
    suspect_s: float = 10.0  # a worker found dead is avoided this long (the scheduler's heartbeat timeout)
    connect_timeout_s: float = 3.0  # at start: how long to wait for the scheduler before serving anyway

    def __post_init__(self) -> None:
        if min(self.call_timeout_s, self.view_refresh_s, self.retry_scheduler_after_s, self.connect_timeout_s) <= 0:
            raise ValueError("call_timeout_s, view_refresh_s, retry_scheduler_after_s and connect_timeout_s "
                             "must be positive")


class RouterClient:
    """The gateway's routing client; create inside the gateway's event loop, `close()` at shutdown."""

    def __init__(
        self,
        scheduler_address: str | None,
        static_workers: StaticWorkers | None = None,
        config: RouterConfig | None = None,
        cluster_token: ClusterToken | None = None,
    ) -> None:
        if scheduler_address is None and static_workers is None:
            raise ValueError("RouterClient needs a scheduler address, static workers, or both")
        self.config = config or RouterConfig()
        self.view = static_view(static_workers)
        self._channel = None if scheduler_address is None else internal_channel(
            scheduler_address, cluster_token, options=_CHANNEL_OPTIONS)
        self._stub = None if self._channel is None else pb_grpc.SchedulerStub(self._channel)
        self._down_until = 0.0  # monotonic time before which the scheduler is not asked
        self._in_outage = False  # only for logging the start and end of an outage once each
        self._view_at = -float("inf")
        self._refreshing: asyncio.Task[bool] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._suspects: dict[str, float] = {}  # address -> monotonic time until which it is avoided

    @property
    def scheduler_available(self) -> bool:
        """False while routing from the last view after a failure (for /readyz and logs)."""
        return self._stub is not None and time.monotonic() >= self._down_until

    def report_lost(self, address: str, reason: WorkerFailure, detail: str = "") -> None:
        """A Generate call lost `address`: avoid it for `suspect_s` and tell the scheduler (see the module
        docstring); never blocks or fails the caller."""
        if address not in self._avoided(frozenset()):
            log.warning("worker %s lost (%s); avoiding it for %.0f s", address, reason.value, self.config.suspect_s)
            if self._stub is not None:
                self._spawn(self._send_failure(self._stub, address, reason, detail))
        self._suspects[address] = time.monotonic() + self.config.suspect_s

    def _avoided(self, avoid: frozenset[str]) -> frozenset[str]:
        now = time.monotonic()
        for address in [a for a, until in self._suspects.items() if until <= now]:
            del self._suspects[address]
        return avoid.union(self._suspects)

    async def route(self, summary: RequestSummary, avoid: frozenset[str] = frozenset()) -> RoutingDecision:
        """Place `summary` on workers other than those in `avoid` (and those reported unreachable)."""
        avoid = self._avoided(avoid)
        if self._stub is None:
            return self._route_locally(summary, RouteSource.STATIC, avoid)
        if time.monotonic() >= self._down_until:
            try:
                decision = await self._ask_scheduler(self._stub, summary)
            except grpc.aio.AioRpcError as e:
                if e.code() in _CALLER_ERRORS:
                    raise RoutingError(f"scheduler refused {summary.request_id}: {e.details()}") from e
                self._mark_down(f"{e.code().name}: {e.details()}")
            except TimeoutError:
                self._mark_down(f"no answer within {self.config.call_timeout_s} s")
                # A slow scheduler may still place it: tell it the request went elsewhere.
                self._spawn(self._send_finished(self._stub, summary.request_id))
            except _NoAnswer as e:
                self._mark_down(str(e))
            else:
                self._mark_up()
                self._maybe_refresh_view()
                if decision.decode_address not in avoid:
                    return decision
                log.info("scheduler placed %s on avoided worker %s; routing it from the last view",
                         summary.request_id, decision.decode_address)
                self._spawn(self._send_finished(self._stub, summary.request_id))
        return self._route_locally(summary, RouteSource.LAST_VIEW, avoid)

    async def finished(self, request_id: str) -> None:
        """Release the request's hold (fire and forget: never blocks or fails the caller)."""
        self.view.done(request_id)
        if self._stub is None or not self.scheduler_available:
            return
        self._spawn(self._send_finished(self._stub, request_id))

    async def start(self) -> None:
        """Connect to the scheduler and take its worker list before the first request, so that request's
        `call_timeout_s` is not spent setting up the channel (a first Route call on a fresh channel was
        2-3x slower than the next here, and a gateway's first request had no view to fall back on).
        Never fails: an absent scheduler is the first request's outage, as before."""
        if self._channel is None:
            return
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await self._channel.channel_ready()
        except TimeoutError:
            log.warning("scheduler not reachable within %.1f s of start; requests will try it again",
                        self.config.connect_timeout_s)
            return
        await self.refresh_view()

    async def refresh_view(self) -> bool:
        """Replace the last view with the scheduler's live workers; False when it can't be reached.

        An empty list keeps the old view: a scheduler that just restarted knows no workers yet,
        and forgetting them would leave nothing to fall back on if it fails again right away.
        """
        if self._stub is None:
            return False
        try:
            response = await self._stub.ListWorkers(pb.ListWorkersRequest(), timeout=self.config.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("listing workers failed: %s", e.code().name)
            return False
        self._view_at = time.monotonic()
        workers = [w for w in map(known_worker, response.workers) if w is not None]
        if workers:
            self.view.replace(workers)
        return True

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    # ---- internals -----------------------------------------------------------------------------

    async def _ask_scheduler(self, stub: pb_grpc.SchedulerStub, summary: RequestSummary) -> RoutingDecision:
        call = stub.Route(
            summary_to_proto(summary), timeout=self.config.call_timeout_s + self.config.max_queue_wait_s
        )
        try:
            # The answer, or QUEUE while it waits, must come quickly; the wait itself may be long.
            async with asyncio.timeout(self.config.call_timeout_s):
                response = await call.read()
            if response is not grpc.aio.EOF and response.kind == pb.RouteResponse.KIND_QUEUE:
                response = await call.read()
        except BaseException:
            call.cancel()  # a cancelled caller must also leave the scheduler's queue
            raise
        if response is grpc.aio.EOF:
            raise _NoAnswer("Route stream ended without a decision")
        return _decision_from_response(summary.request_id, response)

    def _route_locally(self, summary: RequestSummary, source: RouteSource,
                       avoid: frozenset[str] = frozenset()) -> RoutingDecision:
        picked = self.view.pick(summary, self.config.min_remote_prefill_tokens, avoid)
        if picked is None:
            return RoutingDecision(
                summary.request_id, RouteKind.REJECT, source,
                reason=Reason.NO_WORKERS, retry_after_s=NO_VIEW_RETRY_AFTER_S,
            )
        decode, prefill = picked
        return RoutingDecision(
            summary.request_id, RouteKind.ROUTE, source,
            decode_address=decode, prefill_address=prefill, max_tokens=summary.max_tokens,
        )

    def _mark_down(self, why: str) -> None:
        if not self._in_outage:
            log.warning("scheduler unreachable (%s); routing from the last view of %d workers", why,
                        len(self.view.workers))
            self._in_outage = True
        self._down_until = time.monotonic() + self.config.retry_scheduler_after_s

    def _mark_up(self) -> None:
        """An answer came: the scheduler is there, so route through it again at once. (A call that
        was already in flight when another timed out proves it; waiting out `retry_scheduler_after_s`
        then would route a burst from the last view for nothing: on the 4-GPU runs such answers came
        24-97 ms after a single late one.)"""
        self._down_until = 0.0
        if self._in_outage:
            log.warning("scheduler reachable again; routing through it")
            self._in_outage = False

    def _maybe_refresh_view(self) -> None:
        stale = time.monotonic() - self._view_at >= self.config.view_refresh_s
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = self._spawn(self.refresh_view())

    async def _send_finished(self, stub: pb_grpc.SchedulerStub, request_id: str) -> None:
        try:
            await stub.Finished(pb.FinishedRequest(request_id=request_id), timeout=self.config.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            # Lost: the scheduler drops the request's reservations at the worker's next heartbeat
            # anyway; only its TPOT target lingers until the scheduler restarts or the worker dies.
            log.debug("Finished(%s) not delivered: %s", request_id, e.code().name)

    async def _send_failure(self, stub: pb_grpc.SchedulerStub, address: str, reason: WorkerFailure,
                            detail: str) -> None:
        try:
            await stub.ReportWorkerFailure(failure_report_to_proto(address, reason, detail),
                                           timeout=self.config.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            # Lost: the scheduler drops the worker at its heartbeat deadline anyway; this gateway avoids it.
            log.debug("ReportWorkerFailure(%s) not delivered: %s", address, e.code().name)

    def _spawn(self, coroutine: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.create_task(coroutine)
        # Keep a reference: the loop holds tasks weakly and may collect one mid-flight.
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


_KINDS = {
    pb.RouteResponse.KIND_ROUTE: RouteKind.ROUTE,
    pb.RouteResponse.KIND_DEGRADE: RouteKind.DEGRADE,
    pb.RouteResponse.KIND_REJECT: RouteKind.REJECT,
}


def _decision_from_response(request_id: str, response: pb.RouteResponse) -> RoutingDecision:
    kind = _KINDS.get(response.kind)
    if kind is None:  # QUEUE is never a final answer; anything else is a scheduler bug
        raise RoutingError(f"scheduler answered {request_id} with kind {response.kind}")
    return RoutingDecision(
        request_id=request_id,
        kind=kind,
        source=RouteSource.SCHEDULER,
        decode_address=response.decode_worker or None,
        prefill_address=response.prefill_worker or None,
        max_tokens=response.max_tokens or None,
        reason=reason_from_proto(response.reason),
        retry_after_s=response.retry_after_s if response.HasField("retry_after_s") else None,
        predicted_ttft_ms=response.predicted_ttft_ms if response.HasField("predicted_ttft_ms") else None,
        predicted_tpot_ms=response.predicted_tpot_ms if response.HasField("predicted_tpot_ms") else None,
        cached_blocks=response.cached_blocks,
        model=response.model,
    )
