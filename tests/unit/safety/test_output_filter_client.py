"""The output filter's client when its gRPC call ends under a write (services/safety/client.py).

grpc.aio raises `asyncio.InvalidStateError("RPC already finished")`, not an AioRpcError, from `write` when
the call fails while the chunk is queued: a stopped safety service does that at once. That escaped the
fail mode and ended the generation with an exception (seen once in CI). The call below ends the same way,
deterministically."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.safety.categories import Tier
from services.safety.client import CLIENT_FAILURES, FailMode, OutputFilter, SafetyClientConfig


class _EndedCall:
    """A stream-stream call that the transport ended with UNAVAILABLE while a write was queued."""

    def __init__(self) -> None:
        self.cancelled = False

    async def write(self, _: object) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize("mode", list(FailMode))
async def test_a_call_that_ends_under_a_write_answers_the_fail_mode(mode: FailMode) -> None:
    call = _EndedCall()
    failures = CLIENT_FAILURES.labels("output", mode.value, "unavailable")
    before = failures._value.get()
    stream = OutputFilter(call, "org_a", "req-1", SafetyClientConfig(timeout_s=0.3, output_fail_mode=mode))  # type: ignore[arg-type]
    verdict = await stream.feed("Hello")
    assert (verdict.allowed, verdict.tier) == (mode is FailMode.OPEN, Tier.UNAVAILABLE)
    assert stream.degraded and call.cancelled
    assert failures._value.get() == before + 1
