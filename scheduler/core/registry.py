"""Live workers, their last heartbeats, and the load routed to them since.

Liveness uses the scheduler's receipt time, never the worker's `heartbeat_at`, so a skewed worker
clock cannot keep a dead worker alive. A worker silent for longer than `heartbeat_timeout_s` is
dropped on the next call that passes a `now` — it is never routed to again unless it heartbeats
again, when it comes back as a new registration.

Failure reports: a gateway that lost a worker mid-request reports it (`mark_failed`); the worker stays
registered but is unroutable until a heartbeat received after the report clears the mark. So a wrong
report (a gateway's own network trouble) costs a healthy worker one heartbeat interval, never more,
while a dead worker leaves every gateway's routing at once instead of after the timeout.

Prefill rates and arrival rate: each placement's predicted prefill compute, and the prompt itself, feed
two decaying rates on the worker that computes it (prefill_load.py: what they take from a decoding batch
depends on that batch's step, so it is priced per decision), and each placement counts into its decode
worker's rate of arrivals; a load older than `LOAD_REFRESH_S` is rebuilt so that the rates decay. The
rates are observed from a worker's registration, and from the start of the cluster's current busy period
(`restart_rates`, when nothing runs or waits anywhere).

Reservations: each placement adds its load to the chosen workers at once, until the worker's own
load shows it. A worker counts the requests it has taken on (`WorkerSnapshot.requests_received`,
each counted once its status includes it), so a heartbeat whose count grew by n drops the n oldest
reservations: exactly what it now reports, however long the gateway-to-worker hop took. (Dropping
every reservation older than a fixed grace did not: on the 2-core CPU policy runs the hop sometimes
took longer than the 50 ms grace, the heartbeat in between dropped a request the worker had not
received yet, and the next decision placed a second request on a one-slot worker that already had
one coming; docs/benchmarks.md, scheduler policies, pass R.) A reservation whose request never
arrives (a gateway that died, a dispatch that failed and was routed again) is dropped after
`dispatch_timeout_s`. A worker that does not report the count falls back to the grace rule: a
heartbeat received at `now` includes every reservation made before `now - dispatch_grace_s`.
Counting a request twice for one heartbeat is preferred to not counting it: undercounting herds the
next requests onto the worker.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Container
from dataclasses import dataclass, fields

from scheduler.core.cluster_view import WorkerLoad
from scheduler.core.prefill_load import DecayingRate, FoldedCost, prefill_chunks
from scheduler.types import WorkerSnapshot


@dataclass(frozen=True)
class Reservation:
    prefill_tokens: int = 0
    prefill_requests: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0
    blocks: int = 0

    def plus(self, other: Reservation) -> Reservation:
        return Reservation(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class RateWindow:
    """How a worker's prefill rates and arrival rate are averaged (prefill_load.DecayingRate)."""

    time_constant_s: float = 10.0
    min_s: float = 2.0

    def __post_init__(self) -> None:
        if self.time_constant_s <= 0 or self.min_s <= 0:
            raise ValueError("a rate window needs time_constant_s > 0 and min_s > 0")


def _arrived(before: int | None, now: int | None) -> int | None:
    """Requests a worker took on between two heartbeats, or None when the two counts cannot say (it does
    not count them, or the count went back: the worker restarted under the same id)."""
    if now is None or before is None or now < before:
        return None
    return now - before


def _batch_context_tokens(s: WorkerSnapshot, r: Reservation) -> int:
    """The summed context of every sequence in the decode batch. The worker reports its running
    sequences' context and each reservation carries its own; sequences waiting in the worker (for a
    slot, or for remote KV) are reported by count only, so each is taken at the mean of the others (at
    the mean pending prompt when none runs). Leaving them at zero diluted the batch's mean context:
    a one-slot CPU worker with two waiting priced its slot waits at a third of its context, and a
    cost model early in a run, whose step still grew with context, at 33 ms steps it ran at 85
    (docs/benchmarks.md, scheduler policies, pass S)."""
    known_seqs = s.running_seqs + r.decode_seqs
    known = s.running_context_tokens + r.context_tokens
    waiting = s.queue_depth + s.waiting_for_remote_kv
    if not waiting:
        return known
    if known_seqs:
        return known + waiting * known // known_seqs
    return waiting * s.inflight_prefill_tokens // max(s.inflight_prefill_requests, 1)


# Mixed steps a worker reports before their measured cost per prompt chunk replaces the forecast
# (prefill_load.py): a few heartbeats' worth on a GPU, where one step in two or three is mixed under load.
MIN_FOLDED_STEPS = 8

# The prefill share changes with time alone; rebuilding a worker's load this often keeps it current
# without rebuilding every worker for every decision (64 workers at 1,000 decisions/s).
LOAD_REFRESH_S = 0.25


class _WorkerRecord:
    def __init__(self, snapshot: WorkerSnapshot, now: float, window: RateWindow) -> None:
        self.snapshot = snapshot
        self.last_seen = now
        # predicted prefill seconds per second, prompts and their chunks prefilled per second,
        # decode placements per second
        self.prefill_work = DecayingRate(window.time_constant_s, since=now, min_window_s=window.min_s)
        self.prefills = DecayingRate(window.time_constant_s, since=now, min_window_s=window.min_s)
        self.prefill_chunks = DecayingRate(window.time_constant_s, since=now, min_window_s=window.min_s)
        # What a prompt chunk folded into its decoding steps costs (kept across idle periods: it is a
        # property of the worker and the workload, not a rate of the load now).
        self.folded = FoldedCost(window.time_constant_s, MIN_FOLDED_STEPS)
        self.arrivals = DecayingRate(window.time_constant_s, since=now, min_window_s=window.min_s)
        self.reservations: deque[tuple[float, Reservation]] = deque()
        self.reserved = Reservation()
        self.tpot_targets: Counter[float] = Counter()  # TPOT targets (ms) of unfinished requests here
        self.failed = False  # reported failed by a gateway since its last heartbeat: not routable
        self._load: WorkerLoad | None = None  # built on demand; every change below clears it
        self._built_at = -math.inf

    def changed(self) -> None:
        self._load = None

    def load(self, now: float) -> WorkerLoad:
        if self._load is None or now - self._built_at >= LOAD_REFRESH_S:
            self._load = self._build_load(now)
            self._built_at = now
        return self._load

    def _build_load(self, now: float) -> WorkerLoad:
        s, r = self.snapshot, self.reserved
        return WorkerLoad(
            snapshot=s,
            queued_prefill_tokens=s.inflight_prefill_tokens + r.prefill_tokens,
            queued_prefill_requests=max(s.queue_depth, s.inflight_prefill_requests) + r.prefill_requests,
            decode_batch=s.running_seqs + s.queue_depth + s.waiting_for_remote_kv + r.decode_seqs,
            context_tokens=_batch_context_tokens(s, r),
            free_blocks=max(s.free_blocks - r.blocks, 0),
            tightest_tpot_ms=min(self.tpot_targets) if self.tpot_targets else None,
            prefill_work_rate=self.prefill_work.value(now),
            prefill_rate=self.prefills.value(now),
            prefill_chunk_rate=self.prefill_chunks.value(now),
            folded_s_per_chunk=self.folded.per_chunk_s(now),
            folded_s_per_step=self.folded.per_step_s(now),
            arrival_rate=self.arrivals.value(now),
            heartbeat_age_s=max(now - self.last_seen, 0.0),
        )


class WorkerRegistry:
    def __init__(
        self, heartbeat_timeout_s: float, dispatch_grace_s: float, prefill_window: RateWindow | None = None,
        dispatch_timeout_s: float = 5.0,
    ) -> None:
        if heartbeat_timeout_s <= 0 or dispatch_grace_s < 0 or dispatch_timeout_s < dispatch_grace_s:
            raise ValueError("need heartbeat_timeout_s > 0 and 0 <= dispatch_grace_s <= dispatch_timeout_s")
        self._timeout_s = heartbeat_timeout_s
        self._grace_s = dispatch_grace_s
        self._dispatch_timeout_s = dispatch_timeout_s
        self._prefill_window = prefill_window or RateWindow()
        self._workers: dict[str, _WorkerRecord] = {}
        self._oldest_seen = math.inf  # a lower bound of every worker's last_seen (see `expire`)
        self._placed_on: dict[str, tuple[str, float]] = {}  # request id -> (decode worker, TPOT ms)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def snapshot(self, worker_id: str) -> WorkerSnapshot:
        return self._workers[worker_id].snapshot

    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    def update(self, snapshot: WorkerSnapshot, now: float) -> bool:
        """Record a heartbeat; True when the worker was not registered (new or back from the dead)."""
        record = self._workers.get(snapshot.worker_id)
        if record is None:
            self._workers[snapshot.worker_id] = _WorkerRecord(snapshot, now, self._prefill_window)
            self._oldest_seen = min(self._oldest_seen, now)
            return True
        arrived = _arrived(record.snapshot.requests_received, snapshot.requests_received)
        record.snapshot = snapshot
        record.last_seen = now
        self._oldest_seen = min(self._oldest_seen, now)  # a lower bound even if `now` went back
        record.failed = False  # alive after all (or again): routable
        record.changed()
        self._settle(record, arrived, now)
        return False

    def _settle(self, record: _WorkerRecord, arrived: int | None, now: float) -> None:
        """Drop the reservations a heartbeat's load now includes (see the module doc): the `arrived`
        oldest, or without a count those older than the grace; and any older than the dispatch timeout."""
        reservations = record.reservations
        if arrived is None:
            cutoff = now - self._grace_s
        else:
            cutoff = now - self._dispatch_timeout_s
            for _ in range(min(arrived, len(reservations))):
                reservations.popleft()
        while reservations and reservations[0][0] <= cutoff:
            reservations.popleft()
        record.reserved = Reservation()
        for _, reservation in reservations:
            record.reserved = record.reserved.plus(reservation)

    def mark_failed(self, worker_id: str) -> None:
        """A gateway saw the worker fail: unroutable until its next heartbeat (KeyError: unknown)."""
        self._workers[worker_id].failed = True

    def is_failed(self, worker_id: str) -> bool:
        record = self._workers.get(worker_id)
        return record is not None and record.failed

    def expire(self, now: float) -> list[str]:
        """Drop workers silent for longer than the timeout; returns their ids."""
        if now - self._oldest_seen <= self._timeout_s:
            return []  # nobody can be late yet: this runs for every routing decision
        dead = [wid for wid, r in self._workers.items() if now - r.last_seen > self._timeout_s]
        for worker_id in dead:
            del self._workers[worker_id]
        self._oldest_seen = min((r.last_seen for r in self._workers.values()), default=math.inf)
        if dead:
            self._placed_on = {rid: v for rid, v in self._placed_on.items() if v[0] not in dead}
        return dead

    def reserve(self, worker_id: str, reservation: Reservation, now: float) -> None:
        """One request's load on one worker (one reservation per request and worker: a heartbeat's count
        of requests received drops that many, see the module doc)."""
        record = self._workers[worker_id]
        record.reservations.append((now, reservation))
        record.reserved = record.reserved.plus(reservation)
        record.changed()

    def record_prefill(self, worker_id: str, compute_s: float, new_tokens: int, now: float) -> None:
        """A placement's prompt will be prefilled here: `new_tokens` uncached, in about `compute_s` (its
        cost model's estimate). Its chunks count towards the folded cost when others decode here
        besides it (a decode reservation other than its own): they will ride their steps."""
        record = self._workers[worker_id]
        chunks = prefill_chunks(new_tokens, record.snapshot.max_prefill_chunk)
        record.prefill_work.add(compute_s, now)
        record.prefills.add(1.0, now)
        record.prefill_chunks.add(float(chunks), now)
        if record.snapshot.running_seqs + record.reserved.decode_seqs > 1:
            record.folded.add_chunks(chunks, now)
        record.changed()

    def record_folded(self, worker_id: str, excess_s: float, now: float) -> None:
        """A mixed step the worker reported, `excess_s` over its batch's decode step."""
        record = self._workers[worker_id]
        record.folded.add_step(excess_s, now)
        record.changed()

    def idle(self, now: float) -> bool:
        """Whether nothing runs or waits on any worker, as reported and reserved since. Runs per
        decision: stops at the first busy worker, without listing every load."""
        for record in self._workers.values():
            load = record.load(now)
            if load.decode_batch or load.queued_prefill_requests:
                return False
        return True

    def restart_rates(self, now: float) -> None:
        """Start every worker's prefill and arrival rates afresh: a new busy period begins (see
        module doc)."""
        for record in self._workers.values():
            record.prefill_work.restart(now)
            record.prefills.restart(now)
            record.prefill_chunks.restart(now)
            record.arrivals.restart(now)
            record.changed()

    def track(self, request_id: str, decode_worker_id: str, tpot_ms: float, now: float) -> None:
        """Remember a placed request's TPOT target on its decode worker until it finishes, and count
        it into the worker's arrival rate."""
        record = self._workers[decode_worker_id]
        record.arrivals.add(1.0, now)
        record.tpot_targets[tpot_ms] += 1
        record.changed()
        self._placed_on[request_id] = (decode_worker_id, tpot_ms)

    def untrack(self, request_id: str) -> str | None:
        """Forget a finished request; returns the decode worker it ran on, if still tracked."""
        placed = self._placed_on.pop(request_id, None)
        if placed is None:
            return None
        worker_id, tpot_ms = placed
        record = self._workers.get(worker_id)
        if record is not None:
            record.tpot_targets[tpot_ms] -= 1
            if record.tpot_targets[tpot_ms] <= 0:
                del record.tpot_targets[tpot_ms]
            record.changed()
        return worker_id

    def holds_work(self, worker_id: str) -> bool:
        """Whether placements on the worker are unfinished or not yet visible in its heartbeats."""
        record = self._workers[worker_id]
        return bool(record.reservations) or bool(record.tpot_targets)

    def loads(self, now: float) -> list[WorkerLoad]:
        return [record.load(now) for record in self._workers.values()]

    def load(self, worker_id: str, now: float) -> WorkerLoad:
        return self._workers[worker_id].load(now)

    def routable_loads(self, now: float, draining: Container[str]) -> list[WorkerLoad]:
        """Loads of the workers not reported failed, less those in `draining` (one pass: this runs
        for every routing decision)."""
        return [record.load(now) for worker_id, record in self._workers.items()
                if not record.failed and worker_id not in draining]
