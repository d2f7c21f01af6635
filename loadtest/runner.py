"""One benchmark run: sessions started on an arrival schedule, turns sent in order, records collected.

Open loop: session start times come from the arrival process, fixed before the run, and do not wait
for the server. `max_concurrency` caps requests in flight (a semaphore, as in vLLM); a request's
clock starts when it is actually sent, after the semaphore, so client-side queueing is not charged
to the server -- at rate = inf this makes a fixed-concurrency closed loop.

Multi-turn sessions send turn t+1 only after turn t finished, with the full conversation so far
(system prompt, earlier user turns and the answers actually received). If a turn fails, the later
turns of that conversation are recorded as `skipped` misses rather than silently dropped.

Bounded: `num sessions` x `turns` requests at most, each within the client's request timeout; with
`max_duration`, nothing new is sent after that many seconds (those requests are counted as
`not_sent`, outside every denominator, and the result says so).

Trust: a watchdog task measures how late the event loop wakes up (`loop_lag_ms`). Every timestamp
is taken on this loop, so a large lag means the client itself was the bottleneck and the latency
figures are inflated; the report shows it next to the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from loadtest.arrivals import make_arrivals
from loadtest.faults import FaultInjector
from loadtest.metrics import distribution_ms, skipped_record
from loadtest.records import Message, RequestRecord, Session

LAG_PROBE_S = 0.01


@dataclass(frozen=True)
class RunConfig:
    request_rate: float  # sessions per second; math.inf = all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival gaps; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most
    max_duration: float | None = None  # seconds after which nothing new is sent
    seed: int = 0  # seeds the arrival schedule
    progress: bool = True  # a tqdm bar on stderr


@dataclass
class RunResult:
    """Everything measured in one run (one request rate)."""

    request_rate: float
    arrivals: dict[str, Any]
    max_concurrency: int | None
    records: list[RequestRecord]
    duration: float  # run start -> last request finished
    not_sent: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    loop_lag_ms: dict[str, Any] = field(default_factory=dict)


class SendsRequests(Protocol):
    """What the runner needs from a client (`OpenAIStreamClient` in production, fakes in tests): send one
    request, fill `record` in place (never raising for a failed request) and return it."""

    async def send(self, messages: list[Message], record: RequestRecord) -> RequestRecord: ...


class BenchRunner:
    """Runs one rate of a benchmark: make a new runner per run (it accumulates that run's records)."""

    def __init__(self, client: SendsRequests, config: RunConfig, injector: FaultInjector | None = None) -> None:
        self._client = client
        self.config = config
        self._injector = injector
        self._sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self._records: list[RequestRecord] = []
        self._not_sent = 0
        self._failed = 0
        self._t0 = 0.0
        self._deadline = math.inf
        self._bar: tqdm | None = None

    async def run(self, sessions: list[Session]) -> RunResult:
        arrivals = make_arrivals(self.config.request_rate, self.config.burstiness)
        offsets = arrivals.schedule(len(sessions), random.Random(self.config.seed))
        total = sum(len(s.turns) for s in sessions)
        self._bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not self.config.progress,
                         desc=f"rate {self.config.request_rate:g}", mininterval=0.5)
        lags: list[float] = []
        self._t0 = time.perf_counter()
        if self.config.max_duration is not None:
            self._deadline = self._t0 + self.config.max_duration
        helpers = [asyncio.create_task(self._watch_loop(lags))]
        if self._injector is not None:
            helpers.append(asyncio.create_task(self._injector.run(self._t0)))
        try:
            await asyncio.gather(*(self._run_session(s, off) for s, off in zip(sessions, offsets, strict=True)))
        finally:
            for task in helpers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._bar.close()
        return self._result(arrivals.describe(), lags)

    def _result(self, arrivals: dict[str, Any], lags: list[float]) -> RunResult:
        ends = [r.send_time + (r.e2e or 0.0) for r in self._records]
        duration = max(ends, default=time.perf_counter() - self._t0)
        self._records.sort(key=lambda r: (r.send_time, r.session_id, r.turn))
        lag = distribution_ms(lags)
        return RunResult(self.config.request_rate, arrivals, self.config.max_concurrency, self._records,
                         duration, self._not_sent, self._injector.report() if self._injector else [],
                         {"p99": lag["p99"], "max": lag["max"], "samples": len(lags)})

    async def _watch_loop(self, lags: list[float]) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(max(0.0, time.perf_counter() - t - LAG_PROBE_S))

    async def _run_session(self, session: Session, offset: float) -> None:
        await asyncio.sleep(max(0.0, self._t0 + offset - time.perf_counter()))
        history: list[Message] = []
        context_len = 0
        if session.system_prompt is not None:
            history.append({"role": "system", "content": session.system_prompt})
            context_len = session.system_prompt_len
        for i, turn in enumerate(session.turns):
            messages = history + list(turn.messages)
            record = RequestRecord(f"{session.session_id}-{i}", session.session_id, i, 0.0,
                                   prompt_len=context_len + turn.prompt_len, max_tokens=turn.output_len)
            if not await self._send(messages, record):
                self._not_sent += len(session.turns) - i
                return
            if not record.ok:
                self._skip_rest(session, i + 1, record.send_time + (record.e2e or 0.0))
                return
            history = messages + [{"role": "assistant", "content": record.output_text}]
            context_len = record.prompt_len + record.output_tokens

    async def _send(self, messages: list[Message], record: RequestRecord) -> bool:
        """Send unless the deadline passed (checked after waiting for a concurrency slot)."""
        async with self._sem if self._sem is not None else contextlib.nullcontext():
            now = time.perf_counter()
            if now >= self._deadline:
                return False
            record.send_time = now - self._t0
            await self._client.send(messages, record)
        self._done(record)
        return True

    def _skip_rest(self, session: Session, first: int, at: float) -> None:
        for i in range(first, len(session.turns)):
            self._done(skipped_record(f"{session.session_id}-{i}", session.session_id, i, at))

    def _done(self, record: RequestRecord) -> None:
        self._records.append(record)
        assert self._bar is not None
        self._failed += 0 if record.ok else 1
        self._bar.update(1)
        self._bar.set_postfix(ok=len(self._records) - self._failed, failed=self._failed, refresh=False)
