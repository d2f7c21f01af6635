"""`StreamRelay`: how a stream's replay log reaches other gateway replicas, and their cancels reach it.

Two implementations: `LocalOnly` (no Redis: a stream is resumable and cancellable on the replica that
runs it only) and `RedisRelay` (redis_relay.py: the log mirrored into a Redis Stream, cancels and
reader heartbeats over pub/sub), built when `BATON_REDIS_URL` is set.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from services.gateway.config import StreamConfig
from services.gateway.streams.replay_log import EventLog, StreamOwner, StreamSource, not_found


class OwnerSignal(StrEnum):
    CANCEL = "cancel"  # abort the generation now
    READING = "reading"  # a reader on another replica follows the stream (postpones a detached abort)


class StreamRelay(Protocol):
    async def start(self) -> None: ...

    def publish(self, event_log: EventLog) -> None:
        """Make a new local log readable from other replicas (returns at once)."""
        ...

    async def open_remote(self, stream_id: str, owner: StreamOwner, after_seq: int) -> StreamSource:
        """A stream run by another replica, to follow after `after_seq` (404, 410 or 503 raised here)."""
        ...

    async def cancel_remote(self, stream_id: str, owner: StreamOwner) -> bool:
        """Abort a stream run by another replica; False when it had already finished."""
        ...

    async def close(self) -> None: ...


class LocalOnly:
    """No Redis: streams are resumable and cancellable on the replica that runs them only."""

    def __init__(self, config: StreamConfig) -> None:
        self.config = config

    async def start(self) -> None:
        return None

    def publish(self, event_log: EventLog) -> None:
        return None

    async def open_remote(self, stream_id: str, owner: StreamOwner, after_seq: int) -> StreamSource:
        raise not_found(stream_id, self.config)

    async def cancel_remote(self, stream_id: str, owner: StreamOwner) -> bool:
        raise not_found(stream_id, self.config)

    async def close(self) -> None:
        return None
