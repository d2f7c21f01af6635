"""Replay buffers: ordered follow, bounded replay, key scoping, expiry, and the detach grace period: a stream
whose last follower left runs on until the grace ends (or a follower, local or remote, comes back)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.gateway.config import StreamConfig
from services.gateway.errors import BadRequestError, StreamGoneError
from services.gateway.streams.replay_log import EventLog, StreamHub, StreamOwner, parse_last_event_id

ORG = StreamOwner(uuid.uuid4(), uuid.uuid4())


async def _collect(log: EventLog, after: int, keepalive_s: float = 10.0) -> list[str | None]:
    return [None if e is None else e.data async for e in log.follow(after, keepalive_s)]


async def test_a_follower_gets_buffered_then_live_events_until_the_end() -> None:
    log = EventLog("s", ORG, 16)
    log.append("a")
    follower = asyncio.create_task(_collect(log, -1))
    await asyncio.sleep(0.01)
    log.append("b")
    log.append("[DONE]")
    log.finish()
    assert await follower == ["a", "b", "[DONE]"]


async def test_replay_starts_after_the_given_event() -> None:
    log = EventLog("s", ORG, 16)
    for data in "abcd":
        log.append(data)
    log.finish()
    assert await _collect(log, 1) == ["c", "d"]


async def test_an_idle_stream_yields_keepalives() -> None:
    log = EventLog("s", ORG, 16)
    follower = asyncio.create_task(_collect(log, -1, keepalive_s=0.02))
    await asyncio.sleep(0.07)
    log.finish()
    assert (await follower).count(None) >= 2


async def test_keepalives_come_only_when_nothing_was_sent_for_an_interval() -> None:
    log = EventLog("s", ORG, 64)
    follower = asyncio.create_task(_collect(log, -1, keepalive_s=0.2))
    for i in range(20):  # 100 ms of events, 5 ms apart: no keep-alive between them
        log.append(str(i))
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.5)  # then idle: about two
    log.finish()
    got = await follower
    assert [x for x in got if x is not None] == [str(i) for i in range(20)]
    assert 1 <= got.count(None) <= 3
    assert got.index(None) == 20  # unless the machine stalled for a whole interval mid-flow


async def test_a_follower_cancelled_as_an_event_arrives_stops() -> None:
    # The SSE response cancels its follower when the client disconnects. With asyncio.wait_for (Python
    # 3.11) a cancel landing after the event woke the wait but before the follower resumed was swallowed,
    # and the follower streamed on to a gone client until the generation ended.
    log = EventLog("s", ORG, 16)
    follower = asyncio.create_task(_collect(log, -1))
    await asyncio.sleep(0.01)
    log.append("a")
    await asyncio.sleep(0)  # the wait is woken; the follower has not run yet
    follower.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(follower, 1.0)


def test_events_dropped_from_the_bounded_buffer_are_gone() -> None:
    log = EventLog("s", ORG, 3)
    for data in "abcde":
        log.append(data)
    assert [e.data for e in log.events_after(1)] == ["c", "d", "e"]
    with pytest.raises(StreamGoneError):
        log.events_after(0)


def test_events_after_any_cursor_are_exactly_the_newer_buffered_ones() -> None:
    log = EventLog("s", ORG, 5)
    for data in "abcdefgh":  # events 3..7 stay buffered
        log.append(data)
    for seq in range(2, 10):
        assert [e.seq for e in log.events_after(seq)] == list(range(seq + 1, 8))


def test_the_last_follower_disconnecting_requests_an_abort() -> None:
    log = EventLog("s", ORG, 3)
    log.attach()
    log.attach()
    log.detach(disconnected=True)
    assert not log.abort_requested.is_set()
    log.detach(disconnected=True)
    assert log.abort_requested.is_set()


async def test_a_detached_stream_runs_through_its_grace_period_then_is_aborted() -> None:
    log = EventLog("s", ORG, 16, detach_grace_s=0.1)
    log.attach()
    log.detach(disconnected=True)
    assert not log.abort_requested.is_set()
    await asyncio.wait_for(log.abort_requested.wait(), 1.0)


async def test_a_follower_coming_back_within_the_grace_keeps_the_stream() -> None:
    log = EventLog("s", ORG, 16, detach_grace_s=0.3)
    log.attach()
    log.detach(disconnected=True)
    await asyncio.sleep(0.01)
    log.attach()  # the client reconnected
    await asyncio.sleep(0.4)
    assert not log.abort_requested.is_set()
    log.detach(disconnected=False)  # it read to the end and left normally: nothing to abort
    await asyncio.sleep(0.4)
    assert not log.abort_requested.is_set()


async def test_a_remote_reader_postpones_the_abort_until_it_stops_reporting() -> None:
    log = EventLog("s", ORG, 16, detach_grace_s=0.5)
    log.attach()
    log.detach(disconnected=True)
    for _ in range(20):  # a reader on another replica, beating every 50 ms for a second (two graces)
        await asyncio.sleep(0.05)
        log.touch_remote()
    assert not log.abort_requested.is_set()
    await asyncio.wait_for(log.abort_requested.wait(), 1.0)


def test_a_follower_that_cannot_resume_aborts_at_once() -> None:
    log = EventLog("s", ORG, 16, detach_grace_s=30)
    log.attach()
    log.detach(disconnected=True, resumable=False)
    assert log.abort_requested.is_set()


def test_a_finished_stream_is_never_aborted() -> None:
    log = EventLog("s", ORG, 3)
    log.attach()
    log.finish()
    log.detach(disconnected=True)
    assert not log.abort_requested.is_set()


def test_another_key_or_organisation_cannot_see_a_stream() -> None:
    hub = StreamHub(StreamConfig())
    hub.open("s", ORG)
    assert hub.owned("s", ORG) is hub.find("s")
    assert hub.owned("s", StreamOwner(ORG.org_id, uuid.uuid4())) is None  # another key of the same org
    assert hub.owned("s", StreamOwner(uuid.uuid4(), ORG.key_id)) is None


def test_finished_streams_expire_after_the_window_and_the_cap_drops_the_oldest() -> None:
    hub = StreamHub(StreamConfig(replay_window_s=60, max_streams=2))
    first = hub.open("a", ORG)
    first.finish()
    hub.open("b", ORG)
    hub.open("c", ORG)  # over the cap: the oldest finished one goes
    assert hub.owned("a", ORG) is None
    finished = hub.owned("b", ORG)
    assert finished is not None
    finished.finish()
    assert finished.finished_at is not None
    hub.sweep(now=finished.finished_at + 61)
    assert len(hub) == 1


@pytest.mark.parametrize(("value", "expected"), [("cmpl-x:3", ("cmpl-x", 3)), ("a:b:7", ("a:b", 7))])
def test_last_event_id_parsing(value: str, expected: tuple[str, int]) -> None:
    assert parse_last_event_id(value) == expected


@pytest.mark.parametrize("value", ["", "nocolon", "s:x", "s:-5"])
def test_bad_last_event_ids_are_400(value: str) -> None:
    with pytest.raises(BadRequestError):
        parse_last_event_id(value)


def test_a_bare_number_needs_the_stream_from_the_path() -> None:
    assert parse_last_event_id("4", "s") == ("s", 4)
    with pytest.raises(BadRequestError):
        parse_last_event_id("other:4", "s")
