"""Replay logs of SSE streams, for `Last-Event-ID` resumes, and what keeps a detached stream alive.

Every streamed completion writes its events into an `EventLog`; the HTTP response only *follows* the
log. So a client whose connection broke can reconnect (`GET /v1/streams/{stream_id}` or a re-POST,
both with `Last-Event-ID: <stream_id>:<seq>`) and get the events after the last one it saw, then the
live rest. With Redis, the log is also mirrored into a Redis Stream (redis_relay.py), so the
reconnect may land on another gateway replica.

Bounds: a log keeps its newest `replay_max_events` events (a resume from before them is 410 Gone) and
lives `replay_window_s` after its stream finished; the hub keeps at most `max_streams` logs, dropping
the oldest finished ones first. Logs belong to the API key that created them (`StreamOwner`): another
key's or organisation's stream id is a 404 like an unknown one.

Detach rule: when the last follower of an unfinished log disconnects, the generation *detaches*: it
keeps running and logging for `detach_grace_s`, so a reconnect gets the rest. If no follower came
back by then (here, or a remote reader on another replica, which `touch_remote` reports), the
generation is aborted (`abort_requested`: its KV blocks are freed, the tokens so far are billed) and a
later resume replays what was produced up to the abort. `detach_grace_s = 0` aborts at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from services.common.errors import NotFoundError
from services.gateway.config import StreamConfig
from services.gateway.errors import BadRequestError, StreamGoneError
from services.gateway.tenancy.auth import Principal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEvent:
    seq: int
    data: str  # the SSE data line: JSON, or "[DONE]"


@dataclass(frozen=True)
class StreamOwner:
    """Who may resume or cancel a stream: the API key (of its organisation) that started it."""

    org_id: uuid.UUID
    key_id: uuid.UUID

    @classmethod
    def of(cls, principal: Principal) -> StreamOwner:
        return cls(principal.org_id, principal.key_id)


class StreamSource(Protocol):
    """What an SSE response follows: a local `EventLog`, or a remote one read from Redis."""

    @property
    def stream_id(self) -> str: ...

    def follow(self, after_seq: int, keepalive_s: float) -> AsyncIterator[StreamEvent | None]: ...

    def attach(self) -> None: ...

    def detach(self, disconnected: bool, resumable: bool = True) -> None: ...


class EventLog:
    def __init__(self, stream_id: str, owner: StreamOwner, max_events: int, detach_grace_s: float = 0.0) -> None:
        self.stream_id = stream_id
        self.owner = owner
        self.detach_grace_s = detach_grace_s
        self._events: deque[StreamEvent] = deque(maxlen=max_events)
        self._next_seq = 0
        self._waiters: list[asyncio.Future[bool]] = []  # followers waiting for the next event (or the end)
        self.finished_at: float | None = None  # time.monotonic() of finish()
        self.abort_requested = asyncio.Event()
        self._followers = 0
        self._unfollowed_since: float | None = None  # the last follower disconnected then
        self._remote_seen_at = float("-inf")  # a reader on another replica said it follows
        self._grace_timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def append(self, data: str) -> StreamEvent:
        assert not self.finished, f"stream {self.stream_id} already finished"
        event = StreamEvent(self._next_seq, data)
        self._next_seq += 1
        self._events.append(event)
        self._wake()
        return event

    def finish(self) -> None:
        if self.finished_at is None:
            self.finished_at = time.monotonic()
            self._cancel_grace()
            self._wake()

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)

    def _waiter(self) -> asyncio.Future[bool]:
        """A future the next append (or the finish) resolves with False."""
        if len(self._waiters) > 8:  # cancelled waits of an idle log (timeouts) are dropped here
            self._waiters = [w for w in self._waiters if not w.done()]
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return waiter

    def events_after(self, seq: int) -> list[StreamEvent]:
        """Buffered events with a sequence number above `seq` (-1: from the start)."""
        first = self._events[0].seq if self._events else self._next_seq
        if seq + 1 < first:
            raise StreamGoneError(f"events {seq + 1}..{first - 1} of stream {self.stream_id} are no "
                                  "longer buffered")
        # Sequence numbers are contiguous and the newest is last, so the wanted events are the last
        # `count`: taken from the right, a follower at the live edge costs O(new events), not O(log)
        # (a scan of the whole log per token was the gateway's largest CPU cost under load).
        count = self._next_seq - max(seq + 1, first)
        if count <= 0:
            return []
        return list(itertools.islice(reversed(self._events), count))[::-1]

    async def batch_after(self, seq: int, timeout_s: float) -> list[StreamEvent]:
        """The events after `seq`; when there are none yet (and the log runs), waits up to `timeout_s`
        for some. Empty after a timeout, or when the log finished."""
        pending = self.events_after(seq)
        if pending or self.finished:
            return pending
        waiter = self._waiter()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that lands just
        # as the event is set, and the SSE response's follower then streamed on to a gone client until
        # the generation ended (the disconnect tests caught it about one run in four).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await waiter
        return self.events_after(seq)  # also after a timeout: events may have come before we resumed

    async def follow(self, after_seq: int, keepalive_s: float) -> AsyncIterator[StreamEvent | None]:
        """Events after `after_seq`, live until the log finishes; None whenever `keepalive_s` pass idle.

        One keep-alive timer per follower, re-armed when it fires, rather than a timeout around every
        wait: a timer armed and cancelled per token was most of what a token cost this log (~12 us of a
        ~14-us append + wake-up, measured on the 2-core CI machine, 200 streams x 200 tokens)."""
        cursor = after_seq
        keepalive = _Keepalive(asyncio.get_running_loop(), keepalive_s)
        try:
            while True:
                batch = self.events_after(cursor)
                if batch:
                    keepalive.active()
                    for event in batch:
                        cursor = event.seq
                        yield event
                elif self.finished:
                    return
                elif await keepalive.wait(self._waiter()):
                    yield None
        finally:
            keepalive.close()

    def attach(self) -> None:
        self._followers += 1
        self._unfollowed_since = None
        self._cancel_grace()

    def detach(self, disconnected: bool, resumable: bool = True) -> None:
        """A follower left; a disconnect of the last one starts the grace period (aborts at once without
        one, or when the follower could not resume: a response without event ids)."""
        self._followers -= 1
        if not disconnected or self._followers > 0 or self.finished:
            return
        self._unfollowed_since = time.monotonic()
        # Logged with its time: the first step of a disconnect's abort (the worker logs when it arrives).
        log.info("stream %s: its last reader disconnected (detach grace %.1f s)", self.stream_id,
                 self.detach_grace_s if resumable else 0.0)
        if resumable:
            self._grace_over()
        else:
            self.abort_requested.set()

    def touch_remote(self) -> None:
        """A reader on another replica follows this stream (through Redis): it counts as a follower
        for the next `detach_grace_s`."""
        self._remote_seen_at = time.monotonic()

    def _grace_over(self) -> None:
        self._grace_timer = None
        if self._unfollowed_since is None or self.finished:
            return
        idle = time.monotonic() - max(self._unfollowed_since, self._remote_seen_at)
        if idle >= self.detach_grace_s:
            self.abort_requested.set()
        else:
            self._grace_timer = asyncio.get_running_loop().call_later(self.detach_grace_s - idle, self._grace_over)

    def _cancel_grace(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None


class _Keepalive:
    """When a follower has been idle for `interval_s`: its timer fires at most once per interval and, if
    nothing went out meanwhile, resolves the follower's wait with True (a keep-alive is due)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float) -> None:
        self.loop = loop
        self.interval_s = interval_s
        self.last_active = loop.time()
        self.waiter: asyncio.Future[bool] | None = None
        self.handle = loop.call_at(self.last_active + interval_s, self._due)

    def active(self) -> None:
        self.last_active = self.loop.time()

    async def wait(self, waiter: asyncio.Future[bool]) -> bool:
        """Wait for `waiter` (an event or the end: False) or for the keep-alive (True)."""
        self.waiter = waiter
        try:
            return await waiter
        finally:
            self.waiter = None

    def _due(self) -> None:
        now = self.loop.time()
        if now >= self.last_active + self.interval_s:  # a whole interval with nothing sent
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(True)
            self.last_active = now
        self.handle = self.loop.call_at(self.last_active + self.interval_s, self._due)

    def close(self) -> None:
        self.handle.cancel()


def parse_last_event_id(value: str, stream_id: str | None = None) -> tuple[str, int]:
    """`<stream_id>:<seq>` (or a bare `<seq>` when the stream is known from the path)."""
    sid, sep, seq = value.strip().rpartition(":")
    if not sep:
        sid = stream_id or ""
    try:
        number = int(seq)
    except ValueError:
        number = -2
    if not sid or number < -1 or (stream_id is not None and sid != stream_id):
        raise BadRequestError(f"Last-Event-ID must be '<stream id>:<event number>', got {value!r}",
                              "Last-Event-ID")
    return sid, number


class StreamHub:
    """All replay logs of this gateway process (one event loop; not thread-safe)."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def open(self, stream_id: str, owner: StreamOwner) -> EventLog:
        self.sweep()
        log = EventLog(stream_id, owner, self.config.replay_max_events, self.config.detach_grace_s)
        self._logs[stream_id] = log
        return log

    def find(self, stream_id: str) -> EventLog | None:
        """The log of `stream_id` held here, whoever owns it (for signals from other replicas)."""
        return self._logs.get(stream_id)

    def owned(self, stream_id: str, owner: StreamOwner) -> EventLog | None:
        """The log of `stream_id` held here, if `owner` started it."""
        self.sweep()
        log = self._logs.get(stream_id)
        return log if log is not None and log.owner == owner else None

    def sweep(self, now: float | None = None) -> None:
        """Drop expired logs, then the oldest finished ones while over the cap."""
        now = time.monotonic() if now is None else now
        window = self.config.replay_window_s
        for sid, log in list(self._logs.items()):
            if log.finished_at is not None and now - log.finished_at > window:
                del self._logs[sid]
        excess = len(self._logs) - self.config.max_streams
        for sid, log in list(self._logs.items()):
            if excess <= 0:
                break
            if log.finished:
                del self._logs[sid]
                excess -= 1

    def __len__(self) -> int:
        return len(self._logs)


def not_found(stream_id: str, config: StreamConfig) -> NotFoundError:
    return NotFoundError(f"stream {stream_id} not found (streams are kept {config.replay_window_s:.0f}s "
                         "after they finish, for the API key that started them)")
