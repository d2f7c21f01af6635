"""Streams shared by gateway replicas through the real Redis: two `RedisRelay`s with their own hubs stand
for two replicas. A log mirrored by one is followed from the other (from a Last-Event-ID, live, up to
the terminal entry); cancels and reader heartbeats reach the owner over pub/sub; other keys get 404;
trimmed events are 410; Redis down is a 503 for remote streams and a single log line, never a 500."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import pytest

from services.common.errors import DependencyUnavailableError, NotFoundError
from services.gateway.config import StreamConfig
from services.gateway.errors import StreamGoneError
from services.gateway.streams import redis_relay
from services.gateway.streams.redis_relay import RedisRelay
from services.gateway.streams.replay_log import EventLog, StreamHub, StreamOwner, StreamSource
from services.launcher.process import free_port
from services.launcher.redis_server import EmbeddedRedis

OWNER = StreamOwner(uuid.uuid4(), uuid.uuid4())
CONFIG = StreamConfig(keepalive_s=0.2, replay_window_s=30, replay_max_events=64, detach_grace_s=1.0)


async def _relay(url: str, config: StreamConfig = CONFIG) -> RedisRelay:
    relay = RedisRelay(StreamHub(config), url)
    await relay.start()
    return relay


@pytest.fixture
async def replicas(redis_server: EmbeddedRedis) -> AsyncIterator[tuple[RedisRelay, RedisRelay]]:
    a, b = await _relay(redis_server.url), await _relay(redis_server.url)
    await asyncio.sleep(0.1)  # both subscribed
    yield a, b
    await a.close()
    await b.close()


def _stream(owner_relay: RedisRelay) -> EventLog:
    log = owner_relay.hub.open(f"chatcmpl-{uuid.uuid4().hex}", OWNER)
    owner_relay.publish(log)
    return log


async def _read(source: StreamSource, after: int) -> list[str]:
    return [e.data async for e in source.follow(after, 0.2) if e is not None]


async def test_another_replica_follows_from_the_last_event_id_to_the_end(
        replicas: tuple[RedisRelay, RedisRelay]) -> None:
    a, b = replicas
    log = _stream(a)
    for data in ("e0", "e1", "e2"):
        log.append(data)
    await asyncio.sleep(0.1)  # mirrored
    remote = await b.open_remote(log.stream_id, OWNER, after_seq=0)
    reader = asyncio.create_task(_read(remote, 0))
    await asyncio.sleep(0.1)
    log.append("e3")  # live, after the reader started
    log.append("[DONE]")
    log.finish()
    assert await asyncio.wait_for(reader, 5) == ["e1", "e2", "e3", "[DONE]"]
    again = await b.open_remote(log.stream_id, OWNER, after_seq=-1)  # finished: the whole replay, then the end
    assert await asyncio.wait_for(_read(again, -1), 5) == ["e0", "e1", "e2", "e3", "[DONE]"]


async def test_other_keys_and_unknown_streams_are_404(replicas: tuple[RedisRelay, RedisRelay]) -> None:
    a, b = replicas
    log = _stream(a)
    await asyncio.sleep(0.1)
    for owner in (StreamOwner(OWNER.org_id, uuid.uuid4()), StreamOwner(uuid.uuid4(), OWNER.key_id)):
        with pytest.raises(NotFoundError):
            await b.open_remote(log.stream_id, owner, -1)
        with pytest.raises(NotFoundError):
            await b.cancel_remote(log.stream_id, owner)
    with pytest.raises(NotFoundError):
        await b.open_remote("chatcmpl-unknown", OWNER, -1)
    assert not log.abort_requested.is_set()


async def test_a_cancel_from_another_replica_aborts_the_owner_at_once(
        replicas: tuple[RedisRelay, RedisRelay]) -> None:
    a, b = replicas
    log = _stream(a)
    await asyncio.sleep(0.1)
    assert await b.cancel_remote(log.stream_id, OWNER) is True
    await asyncio.wait_for(log.abort_requested.wait(), 2.0)
    log.finish()
    await asyncio.sleep(0.1)
    assert await b.cancel_remote(log.stream_id, OWNER) is False  # already finished: nothing to cancel


async def test_a_remote_reader_keeps_a_detached_stream_alive(replicas: tuple[RedisRelay, RedisRelay]) -> None:
    a, b = replicas
    log = _stream(a)
    log.append("e0")
    log.attach()
    log.detach(disconnected=True)  # the client left replica a; grace 1 s
    await asyncio.sleep(0.05)  # mirrored
    remote = await b.open_remote(log.stream_id, OWNER, -1)
    reader = asyncio.create_task(_read(remote, -1))  # and came back through replica b
    await asyncio.sleep(2.0)  # two grace periods
    assert not log.abort_requested.is_set()
    reader.cancel()  # it left again: the owner aborts one grace period after its last heartbeat
    await asyncio.wait_for(log.abort_requested.wait(), 4.0)


async def test_events_trimmed_from_the_redis_stream_are_410(redis_server: EmbeddedRedis) -> None:
    a = await _relay(redis_server.url, StreamConfig(keepalive_s=0.2, replay_max_events=16))
    b = await _relay(redis_server.url)
    try:
        log = _stream(a)
        for i in range(20):
            log.append(f"e{i}")
            await asyncio.sleep(0.01)  # the mirror keeps up (the local buffer holds 16 too)
        log.finish()
        await asyncio.sleep(0.2)
        with pytest.raises(StreamGoneError):
            await b.open_remote(log.stream_id, OWNER, after_seq=0)
        tail = await b.open_remote(log.stream_id, OWNER, after_seq=15)
        assert await asyncio.wait_for(_read(tail, 15), 5) == ["e16", "e17", "e18", "e19"]
    finally:
        await a.close()
        await b.close()


async def test_a_reader_ends_when_the_owner_replica_is_gone(redis_server: EmbeddedRedis,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_relay, "OWNER_LOST_S", 0.3)
    a, b = await _relay(redis_server.url), await _relay(redis_server.url)
    try:
        log = _stream(a)
        log.append("e0")
        await asyncio.sleep(0.1)
        remote = await b.open_remote(log.stream_id, OWNER, -1)
        await a.close()  # the owner died mid-stream: no terminal entry will ever come
        assert await asyncio.wait_for(_read(remote, -1), 5) == ["e0"]
    finally:
        await b.close()


async def test_redis_down_keeps_streams_local_and_is_a_503_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="services.gateway.tenancy.outage"):
        a = await _relay(dead)
        try:
            logs = [_stream(a) for _ in range(3)]
            for log in logs:
                log.append("e0")
                log.finish()
            await asyncio.sleep(1.5)
            assert [e.data for e in logs[0].events_after(-1)] == ["e0"]  # the local replay is untouched
            with pytest.raises(DependencyUnavailableError):
                await a.open_remote("chatcmpl-elsewhere", OWNER, -1)
            with pytest.raises(DependencyUnavailableError):
                await a.cancel_remote("chatcmpl-elsewhere", OWNER)
        finally:
            await a.close()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["redis-streams unreachable"]
