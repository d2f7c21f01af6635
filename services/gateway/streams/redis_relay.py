"""`RedisRelay`: SSE replay logs shared by gateway replicas through Redis, and cancels across them.

The replica that runs a stream (its *owner*) mirrors the stream's `EventLog` into a Redis Stream, one
per stream id: entry id `0-<seq + 1>` for event `seq`, field `d` the SSE data line, and a last entry
with field `end` once the log finished (the reader's terminal marker). `XADD ... MAXLEN
replay_max_events` bounds it like the local buffer; both keys expire `replay_window_s` after the
stream finished (while it runs, every write pushes the expiry forward). A hash beside it holds who may
read it (organisation and API key), the owner replica and whether it finished. Both keys share the
stream id as hash tag, so they live in one Redis Cluster slot.

A resume on a replica that does not hold the log reads it with `XREAD BLOCK` from the client's
`Last-Event-ID` until the terminal entry (`RemoteStream`), and tells the owner it follows (`reading`
on the owner's pub/sub channel, every `beat_s`), which keeps a detached generation alive there past
its grace period. A cancel from any replica publishes `cancel` on the owner's channel; the owner
aborts the generation at once. A reader whose owner stopped answering (no subscriber on its channel
for `OWNER_LOST_S`) ends its response without `[DONE]`.

Redis down: the owner stops mirroring that stream (it stays resumable on the owner only), the
listener retries every second, a resume or cancel of a stream this replica does not hold answers 503
with Retry-After; the outage is logged once and its end once (outage.py). Never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from services.common.errors import DependencyUnavailableError
from services.gateway.errors import StreamGoneError
from services.gateway.streams.relay import OwnerSignal
from services.gateway.streams.replay_log import (
    EventLog,
    StreamEvent,
    StreamHub,
    StreamOwner,
    StreamSource,
    not_found,
)
from services.gateway.tenancy.outage import OutageLog

log = logging.getLogger(__name__)
OWNER_LOST_S = 5.0  # a remote reader gives up once the owner replica had no subscriber this long
_READ_COUNT = 512  # entries per XREAD
REDIS_DOWN = (RedisError, OSError)  # OSError: ConnectionError, TimeoutError of the socket
Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry as redis-py returns it (RESP2, bytes)


def stream_key(stream_id: str) -> str:
    return f"baton:sse:{{{stream_id}}}"


def meta_key(stream_id: str) -> str:
    return f"baton:sse:{{{stream_id}}}:meta"


def owner_channel(replica: str) -> str:
    return f"baton:sse:owner:{replica}"


def entry_id(seq: int) -> str:
    return f"0-{seq + 1}"


def entry_seq(raw: bytes) -> int:
    return int(raw.split(b"-", 1)[1]) - 1


@dataclass(frozen=True)
class StreamMeta:
    owner: StreamOwner
    replica: str  # the replica that runs (ran) the stream
    done: bool

    def to_redis(self) -> dict[FieldT, EncodableT]:
        return {"org": str(self.owner.org_id), "key": str(self.owner.key_id), "replica": self.replica,
                "done": "1" if self.done else "0"}

    @classmethod
    def from_redis(cls, fields: dict[bytes, bytes]) -> StreamMeta | None:
        try:
            owner = StreamOwner(uuid.UUID(fields[b"org"].decode()), uuid.UUID(fields[b"key"].decode()))
            return cls(owner, fields[b"replica"].decode(), fields.get(b"done") == b"1")
        except (KeyError, ValueError):
            return None  # absent (expired) or not ours


class RedisRelay:
    def __init__(self, hub: StreamHub, redis_url: str) -> None:
        self.hub = hub
        self.config = hub.config
        self.replica = secrets.token_hex(8)
        # Short timeouts for writes and lookups (a request never hangs on Redis); reads that block
        # (XREAD BLOCK, pub/sub) get a client whose socket timeout outlasts the block.
        self.redis: Redis = Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=2)
        self.blocking: Redis = Redis.from_url(redis_url, socket_connect_timeout=1,
                                              socket_timeout=self.config.keepalive_s + 5)
        self.outage = OutageLog("redis-streams")
        self._mirrors: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None

    # ---- the owner's side --------------------------------------------------------------------

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen())

    def publish(self, event_log: EventLog) -> None:
        task = asyncio.get_running_loop().create_task(self._mirror(event_log))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    async def _mirror(self, event_log: EventLog) -> None:
        """Copy the log into Redis as it grows; on a Redis failure the stream stays local-only."""
        cursor, first = -1, True
        try:
            batch = event_log.events_after(cursor)  # the first write (with the owner) goes out at once
            while True:
                done = event_log.finished  # then `batch` holds every event left (no await in between)
                await self._write(event_log, batch, first, done)
                self.outage.succeeded()
                first = False
                cursor = batch[-1].seq if batch else cursor
                if done:
                    return
                batch = await event_log.batch_after(cursor, self.config.keepalive_s)
        except StreamGoneError:  # Redis was slower than the local buffer: the copy would have a gap
            log.warning("stream %s: Redis fell behind its replay buffer; replayable on this replica only",
                        event_log.stream_id)
        except REDIS_DOWN as e:
            self.outage.failed(e)

    def _write(self, event_log: EventLog, batch: list[StreamEvent], first: bool, done: bool) -> Awaitable[object]:
        sid, max_events = event_log.stream_id, self.config.replay_max_events
        pipe = self.redis.pipeline(transaction=False)
        if first:
            pipe.hset(meta_key(sid), mapping=StreamMeta(event_log.owner, self.replica, False).to_redis())
        for event in batch:
            pipe.xadd(stream_key(sid), {"d": event.data}, id=entry_id(event.seq), maxlen=max_events,
                      approximate=False)
        if done:
            pipe.xadd(stream_key(sid), {"end": "1"}, id=entry_id(event_log.next_seq), maxlen=max_events,
                      approximate=False)
            pipe.hset(meta_key(sid), "done", "1")
        # While it runs the keys outlive the idle refresh (one write per keepalive); once done, the window.
        ttl_s = self.config.replay_window_s + (0 if done else 2 * self.config.keepalive_s)
        for key in (meta_key(sid), stream_key(sid)):
            pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        return pipe.execute()

    async def _listen(self) -> None:
        """Signals for the streams this replica runs, from any replica; reconnects after a failure."""
        while True:
            try:
                async with self.blocking.pubsub() as pubsub:
                    await pubsub.subscribe(owner_channel(self.replica))
                    self.outage.succeeded()
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            self._on_signal(message["data"])
            except REDIS_DOWN as e:
                self.outage.failed(e)
                await asyncio.sleep(1.0)

    def _on_signal(self, data: bytes) -> None:
        verb, _, stream_id = data.decode(errors="replace").partition(" ")
        event_log = self.hub.find(stream_id)
        if event_log is None:
            return  # finished and swept, or never ours
        if verb == OwnerSignal.CANCEL:
            event_log.abort_requested.set()
        elif verb == OwnerSignal.READING:
            event_log.touch_remote()

    async def signal(self, replica: str, verb: OwnerSignal, stream_id: str) -> int:
        """Publish to the owner; the number of replicas that heard it (0: the owner is gone)."""
        receivers: int = await self.redis.publish(owner_channel(replica), f"{verb.value} {stream_id}")
        return receivers

    # ---- any replica's side ------------------------------------------------------------------

    async def _meta(self, stream_id: str, owner: StreamOwner) -> StreamMeta:
        try:
            fields = cast("dict[bytes, bytes]", await self.redis.hgetall(meta_key(stream_id)))
        except REDIS_DOWN as e:
            raise self._unavailable(stream_id, e) from e
        meta = StreamMeta.from_redis(fields)
        if meta is None or meta.owner != owner:
            raise not_found(stream_id, self.config)
        return meta

    def _unavailable(self, stream_id: str, error: BaseException) -> DependencyUnavailableError:
        self.outage.failed(error)
        return DependencyUnavailableError(f"stream {stream_id} is not on this gateway replica and Redis, which "
                                          "shares streams between replicas, is unavailable")

    async def open_remote(self, stream_id: str, owner: StreamOwner, after_seq: int) -> StreamSource:
        meta = await self._meta(stream_id, owner)
        try:
            head = cast("list[Entry]", await self.redis.xrange(stream_key(stream_id), count=1))
        except REDIS_DOWN as e:
            raise self._unavailable(stream_id, e) from e
        first = entry_seq(head[0][0]) if head else 0
        if after_seq + 1 < first:
            raise StreamGoneError(f"events {after_seq + 1}..{first - 1} of stream {stream_id} are no longer buffered")
        return RemoteStream(stream_id, meta.replica, self)

    async def cancel_remote(self, stream_id: str, owner: StreamOwner) -> bool:
        meta = await self._meta(stream_id, owner)
        if meta.done:
            return False
        try:
            heard = await self.signal(meta.replica, OwnerSignal.CANCEL, stream_id)
        except REDIS_DOWN as e:
            raise self._unavailable(stream_id, e) from e
        if heard == 0:
            raise DependencyUnavailableError(f"the gateway replica running stream {stream_id} does not answer "
                                             "(if it stopped, its generation stopped with it)")
        return True

    async def close(self) -> None:
        """After the service closed (its streams finished or aborted): flush the mirrors briefly, stop."""
        if self._mirrors:
            await asyncio.wait(set(self._mirrors), timeout=2.0)
        for task in [*self._mirrors, *([self._listener] if self._listener else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.redis.aclose()
        await self.blocking.aclose()


class RemoteStream:
    """A stream another replica runs, read from its Redis Stream (attach/detach: nothing to count here;
    the owner learns of this reader from its `reading` signals)."""

    def __init__(self, stream_id: str, replica: str, relay: RedisRelay) -> None:
        self._stream_id = stream_id
        self.replica = replica
        self.relay = relay
        grace = relay.config.detach_grace_s
        self.beat_s = min(5.0, max(0.2, grace / 3))  # several beats per grace period

    @property
    def stream_id(self) -> str:
        return self._stream_id

    def attach(self) -> None:
        return None

    def detach(self, disconnected: bool, resumable: bool = True) -> None:
        return None

    async def follow(self, after_seq: int, keepalive_s: float) -> AsyncIterator[StreamEvent | None]:
        cursor, last_sent, next_beat, owner_missing_since = after_seq, time.monotonic(), 0.0, None
        block_ms = max(1, int(min(keepalive_s, self.beat_s) * 1000))
        while True:
            now = time.monotonic()
            if now >= next_beat:
                heard = await self.relay.signal(self.replica, OwnerSignal.READING, self.stream_id)
                owner_missing_since = None if heard else (owner_missing_since or now)
                next_beat = now + self.beat_s
            reply = cast("list[tuple[bytes, list[Entry]]]", await self.relay.blocking.xread(
                {stream_key(self.stream_id): entry_id(cursor)}, count=_READ_COUNT, block=block_ms))
            entries = reply[0][1] if reply else []
            for raw_id, fields in entries:
                seq = entry_seq(raw_id)
                if seq != cursor + 1:
                    raise StreamGoneError(f"events {cursor + 1}..{seq - 1} of stream {self.stream_id} were trimmed")
                if b"end" in fields:
                    return
                cursor, last_sent = seq, time.monotonic()
                yield StreamEvent(seq, fields[b"d"].decode())
            if entries:
                continue
            if owner_missing_since is not None and time.monotonic() - owner_missing_since > OWNER_LOST_S:
                log.warning("stream %s: its replica %s is gone; the response ends unfinished",
                            self.stream_id, self.replica)
                return
            if time.monotonic() - last_sent >= keepalive_s:
                last_sent = time.monotonic()
                yield None
