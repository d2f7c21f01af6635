"""The output filter's client when its gRPC call ends under a write, or answers late (services/safety/client.py).

grpc.aio raises `asyncio.InvalidStateError("RPC already finished")`, not an AioRpcError, from `write` when
the call fails while the chunk is queued: a stopped safety service does that at once. That escaped the
fail mode and ended the generation with an exception (seen once in CI). The call below ends the same way,
deterministically."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rpcgen.baton.v1 import safety_pb2
from services.safety.categories import Detector
from services.safety.client import CLIENT_FAILURES, LATE_VERDICTS, FailMode, OutputFilter, SafetyClientConfig


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
    assert (verdict.allowed, verdict.tier) == (mode is FailMode.OPEN, Detector.UNAVAILABLE)
    assert stream.degraded and call.cancelled
    assert failures._value.get() == before + 1


class _SlowCall:
    """A stream-stream call whose service answers every chunk after `delay_s` (a busy classifier)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.cancelled = False

    async def write(self, _: object) -> None:
        return None

    async def read(self) -> safety_pb2.Verdict:
        await asyncio.sleep(self.delay_s)
        return safety_pb2.Verdict(allowed=True, tier=safety_pb2.SAFETY_TIER_CLASSIFIER)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


SLOW_CONFIG = SafetyClientConfig(timeout_s=0.2, per_1k_chars_s=0.0, late_waits=1)


async def test_a_late_verdict_mid_stream_is_waited_for_not_treated_as_an_outage() -> None:
    """0.3 s misses the 0.2 s deadline once: the verdict is still the service's, the stream checked."""
    call = _SlowCall(0.3)
    before = LATE_VERDICTS._value.get()
    stream = OutputFilter(call, "org_a", "req-1", SLOW_CONFIG)  # type: ignore[arg-type]
    verdicts = [await stream.feed("Hello there. "), await stream.feed("How are you?")]
    assert [(v.allowed, v.tier) for v in verdicts] == [(True, Detector.CLASSIFIER)] * 2
    assert not stream.degraded and not call.cancelled
    assert LATE_VERDICTS._value.get() == before + 2


async def test_a_verdict_later_than_every_wait_puts_the_stream_in_the_fail_mode_without_ending_it() -> None:
    """Fail-open (the default): the admitted stream goes on, unchecked, and never ends with an error."""
    call = _SlowCall(1.0)
    stream = OutputFilter(call, "org_a", "req-2", SLOW_CONFIG)  # type: ignore[arg-type]
    first = await stream.feed("Hello there. ")
    assert (first.allowed, first.tier) == (True, Detector.UNAVAILABLE)
    assert stream.degraded and call.cancelled
    later = await stream.feed("More text.")  # no further call, no further wait
    assert (later.allowed, later.tier) == (True, Detector.UNAVAILABLE)


def test_the_deadline_scales_with_the_text() -> None:
    config = SafetyClientConfig(timeout_s=2.0, per_1k_chars_s=1.0)
    assert config.deadline_s(0) == 2.0
    assert config.deadline_s(32_000) == 34.0  # a 5,000-word prompt
