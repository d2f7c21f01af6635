"""The client's fail modes when the safety service is stopped, unreachable or hanging."""

from __future__ import annotations

import socket
import time

from services.safety.categories import Detector
from services.safety.checker import SafetyChecker
from services.safety.client import FailMode, SafetyClient, SafetyClientConfig
from services.safety.server import SafetyServer, SafetyServerConfig

FAST = SafetyClientConfig(timeout_s=0.3)


async def _stopped_server_address(checker: SafetyChecker) -> str:
    srv = SafetyServer(SafetyServerConfig(host="127.0.0.1", port=0), checker)
    port = await srv.start()
    await srv.stop(0)
    return f"127.0.0.1:{port}"


async def test_input_fails_closed_by_default_and_quickly(checker: SafetyChecker) -> None:
    client = SafetyClient(await _stopped_server_address(checker), FAST)
    start = time.monotonic()
    v = await client.check_input("org_a", "hello there")
    assert (v.allowed, v.tier) == (False, Detector.UNAVAILABLE)
    assert time.monotonic() - start < 1.0
    await client.close()


async def test_input_can_be_configured_to_fail_open(checker: SafetyChecker) -> None:
    config = SafetyClientConfig(timeout_s=0.3, input_fail_mode=FailMode.OPEN)
    client = SafetyClient(await _stopped_server_address(checker), config)
    v = await client.check_input("org_a", "hello there")
    assert (v.allowed, v.tier) == (True, Detector.UNAVAILABLE)
    await client.close()


async def test_output_fails_open_once_then_stops_calling(checker: SafetyChecker) -> None:
    client = SafetyClient(await _stopped_server_address(checker), FAST)
    stream = await client.open_output_filter("org_a", "req-1")
    first = await stream.feed("Hello, ")
    start = time.monotonic()
    second = await stream.feed("world.")
    assert first.allowed and first.tier == Detector.UNAVAILABLE and stream.degraded
    assert second.allowed and time.monotonic() - start < 0.05  # no second timeout
    await stream.close()
    await client.close()


async def test_output_can_be_configured_to_fail_closed(checker: SafetyChecker) -> None:
    config = SafetyClientConfig(timeout_s=0.3, output_fail_mode=FailMode.CLOSED)
    client = SafetyClient(await _stopped_server_address(checker), config)
    stream = await client.open_output_filter("org_a", "req-2")
    v = await stream.feed("Hello")
    assert (v.allowed, v.tier) == (False, Detector.UNAVAILABLE)
    await stream.close()
    await client.close()


async def test_a_hanging_server_times_out_within_the_configured_timeout() -> None:
    # A TCP listener that never speaks HTTP/2: connects, then nothing — the timeout must fire.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        client = SafetyClient(f"127.0.0.1:{listener.getsockname()[1]}", FAST)
        start = time.monotonic()
        v = await client.check_input("org_a", "hello")
        elapsed = time.monotonic() - start
        stream = await client.open_output_filter("org_a", "req-3")
        out = await stream.feed("hello")
        await stream.close()
        await client.close()
    assert (v.allowed, v.tier) == (False, Detector.UNAVAILABLE) and 0.25 <= elapsed < 1.0
    assert out.allowed and stream.degraded
