"""Replay buffers of SSE streams, for `Last-Event-ID` resumes.

Every streamed completion writes its events into an `EventLog`; the HTTP response only *follows* the
log. So a client whose connection broke can reconnect (`GET /v1/streams/{stream_id}` or a re-POST,
both with `Last-Event-ID: <stream_id>:<seq>`) and get the events after the last one it saw, then the
live rest if the generation still runs.

Bounds: a log keeps its newest `replay_max_events` events (a resume from before them is 410 Gone) and
lives `replay_window_s` after its stream finished; the hub keeps at most `max_streams` logs, dropping
the oldest finished ones first. Logs are scoped to the organisation that created them: another
organisation's stream id is a 404 like an unknown one.

Abort rule: when the last follower of an unfinished log disconnects, `abort_requested` is set and the
generation is aborted downstream (its KV blocks are freed); a later resume replays what was produced
up to the abort.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.errors import NotFoundError
from services.gateway.config import StreamConfig
from services.gateway.errors import BadRequestError, StreamGoneError


@dataclass(frozen=True)
class StreamEvent:
    seq: int
    data: str  # the SSE data line: JSON, or "[DONE]"


class EventLog:
    def __init__(self, stream_id: str, org_id: uuid.UUID, max_events: int) -> None:
        self.stream_id = stream_id
        self.org_id = org_id
        self._events: deque[StreamEvent] = deque(maxlen=max_events)
        self._next_seq = 0
        self._changed = asyncio.Event()
        self.finished_at: float | None = None  # time.monotonic() of finish()
        self.abort_requested = asyncio.Event()
        self._followers = 0

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

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
            self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def events_after(self, seq: int) -> list[StreamEvent]:
        """Buffered events with a sequence number above `seq` (-1: from the start)."""
        first = self._events[0].seq if self._events else self._next_seq
        if seq + 1 < first:
            raise StreamGoneError(f"events {seq + 1}..{first - 1} of stream {self.stream_id} are no "
                                  "longer buffered")
        return [e for e in self._events if e.seq > seq]

    async def follow(self, after_seq: int, keepalive_s: float) -> AsyncIterator[StreamEvent | None]:
        """Events after `after_seq`, live until the log finishes; None whenever `keepalive_s` pass idle."""
        cursor = after_seq
        while True:
            changed = self._changed
            pending = self.events_after(cursor)
            for event in pending:
                cursor = event.seq
                yield event
            if pending:
                continue
            if self.finished:
                return
            try:
                await asyncio.wait_for(changed.wait(), keepalive_s)
            except TimeoutError:
                yield None

    def attach(self) -> None:
        self._followers += 1

    def detach(self, disconnected: bool) -> None:
        """A follower left; a disconnect of the last one aborts an unfinished generation."""
        self._followers -= 1
        if disconnected and self._followers == 0 and not self.finished:
            self.abort_requested.set()


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

    def open(self, stream_id: str, org_id: uuid.UUID) -> EventLog:
        self.sweep()
        log = EventLog(stream_id, org_id, self.config.replay_max_events)
        self._logs[stream_id] = log
        return log

    def get(self, stream_id: str, org_id: uuid.UUID) -> EventLog:
        self.sweep()
        log = self._logs.get(stream_id)
        if log is None or log.org_id != org_id:
            raise NotFoundError(f"stream {stream_id} not found (streams are kept "
                                f"{self.config.replay_window_s:.0f}s after they finish)")
        return log

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
