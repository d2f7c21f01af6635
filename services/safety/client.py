"""`SafetyClient`: the gateway's handle on the safety service.

    client = SafetyClient("safety:50071")
    verdict = await client.check_input(org_id, prompt)          # before routing: no GPU work if refused
    output = await client.open_output_filter(org_id, request_id, watch=verdict.watch)
    for delta in deltas:
        verdict = await output.feed(delta)                      # allowed=False: abort, free KV, send
        ...                                                     # the partial text + content_filter
    await output.feed("", final=True); await output.close()

Outage behaviour (service down, slow beyond `timeout_s`, or erroring) is a configured fail mode per
direction; the verdict then has tier "unavailable" so the caller can tell an outage from a content
decision (answer a refused prompt with a retryable 503, not `content_filter`). Defaults, and why:

* input: fail-CLOSED. A refused prompt has cost nothing (no routing, no GPU work) and the client may
  retry; admitting unchecked prompts during an outage is exactly what an attacker would wait for.
* output: fail-OPEN. The prompt already passed the (fail-closed) input check; the GPU work is spent;
  halting every in-flight generation on a safety-service blip would turn a partial outage into a
  total one. Organisations that must never see unchecked output set `output_fail_mode=FailMode.CLOSED`
  (the gateway then ends the choice with `content_filter`, saying the check was unavailable).

Deadlines scale with the text (`deadline_s`: `timeout_s`, 2 s by default, plus `per_1k_chars_s` per
1,000 characters), so a 5,000-word prompt is judged, not timed out (see `limits.py`). A text longer
than `limits.MAX_INPUT_CHARS` raises `InputTooLongError` before any call.

Output, mid-stream: a service that fails (an RPC error, the stream ended) puts the stream in the fail
mode at once. A verdict that is only late is waited for `late_waits` more deadlines (the gateway holds
back the tokens past its unchecked allowance meanwhile), since under CPU contention a healthy service
can be slow: only then is the stream put in the fail mode. After that a stream stops calling the
service (`degraded`), so an outage costs each stream one deadline, not one per token. Late verdicts
are counted in `baton_safety_client_late_verdicts_total`; every failure in
`baton_safety_client_failures_total{direction,fail_mode,reason}`. The gateway never waits on output
verdicts for its first token (`OutputGate`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from enum import StrEnum

import grpc
from prometheus_client import Counter

from rpcgen.baton.v1 import safety_pb2, safety_pb2_grpc
from services.common.cluster_auth import ClusterToken, internal_channel
from services.safety.categories import Detector, SafetyVerdict
from services.safety.limits import check_length
from services.safety.wire import verdict_from_pb

log = logging.getLogger(__name__)

CLIENT_FAILURES = Counter("baton_safety_client_failures", "Safety calls that failed and fell back to the fail mode",
                          ["direction", "fail_mode", "reason"])
LATE_VERDICTS = Counter("baton_safety_client_late_verdicts", "Output verdicts that missed one deadline and were "
                        "waited for again")


class FailMode(StrEnum):
    OPEN = "open"      # treat as allowed
    CLOSED = "closed"  # treat as refused / halted


@dataclass(frozen=True)
class SafetyClientConfig:
    timeout_s: float = 2.0        # the deadline of an empty text
    per_1k_chars_s: float = 1.0   # added per 1,000 characters of the text judged
    late_waits: int = 1           # output: deadlines a late (not failed) verdict is waited for again
    input_fail_mode: FailMode = FailMode.CLOSED
    output_fail_mode: FailMode = FailMode.OPEN

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.per_1k_chars_s < 0 or self.late_waits < 0:
            raise ValueError(f"need timeout_s > 0, per_1k_chars_s >= 0, late_waits >= 0: {self}")

    def deadline_s(self, chars: int) -> float:
        """How long a verdict on a text of `chars` characters is waited for."""
        return self.timeout_s + self.per_1k_chars_s * chars / 1000


def unavailable_verdict(mode: FailMode) -> SafetyVerdict:
    return SafetyVerdict(allowed=mode is FailMode.OPEN, category=None, score=0.0, tier=Detector.UNAVAILABLE)


class StreamEndedError(ConnectionError):
    """The output-filter call ended while a chunk was being written to it."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(f"the safety stream ended ({code.name})")
        self.code = code


def _reason(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code().name.lower()
    if isinstance(error, StreamEndedError):
        return error.code.name.lower()
    return "timeout" if isinstance(error, TimeoutError) else type(error).__name__


class OutputFilter:
    """One generation's post-filter stream. Feed deltas in order, one at a time; then `close`."""

    def __init__(self, call: grpc.aio.StreamStreamCall, org_id: str, request_id: str,
                 config: SafetyClientConfig, watch: bool = False) -> None:
        self._call = call
        self._first: safety_pb2.OutputChunk | None = safety_pb2.OutputChunk(org_id=org_id,
                                                                             request_id=request_id, watch=watch)
        self._config = config
        self._halt: SafetyVerdict | None = None
        self.degraded = False  # the service failed once: every later feed answers the fail mode

    async def feed(self, delta: str, final: bool = False) -> SafetyVerdict:
        """The verdict with `delta` appended; allowed=False: halt the generation now."""
        if self._halt is not None:
            return self._halt
        mode = self._config.output_fail_mode
        if self.degraded:
            return self._remember(unavailable_verdict(mode))
        chunk = safety_pb2.OutputChunk(delta=delta, final=final)
        if self._first is not None:
            chunk.MergeFrom(self._first)
            self._first = None
        exchange = asyncio.ensure_future(self._exchange(chunk))
        try:
            verdict = await self._await_verdict(exchange, self._config.deadline_s(len(delta)))
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError) as e:
            self._degrade(mode, _reason(e))
            return self._remember(unavailable_verdict(mode))
        return self._remember(verdict)

    async def _await_verdict(self, exchange: asyncio.Future[SafetyVerdict], deadline_s: float) -> SafetyVerdict:
        """The exchange's verdict; a late one is waited for `late_waits` more deadlines (the chunk is
        not sent again: the stream answers in order). Raises TimeoutError when it never came."""
        try:
            for wait in range(1 + self._config.late_waits):
                done, _ = await asyncio.wait({exchange}, timeout=deadline_s)
                if done:
                    return exchange.result()
                if wait < self._config.late_waits:
                    LATE_VERDICTS.inc()
            raise TimeoutError(f"no verdict within {1 + self._config.late_waits} x {deadline_s:.1f} s")
        finally:
            exchange.cancel()  # no-op when done; else the read is abandoned (the stream is degraded)

    async def _exchange(self, chunk: safety_pb2.OutputChunk) -> SafetyVerdict:
        try:
            await self._call.write(chunk)
        except asyncio.InvalidStateError:
            # grpc.aio's answer when the call ends while the write is queued (a service that is down fails
            # the call at once): not an AioRpcError, so the call's own status says why.
            raise StreamEndedError(await self._call.code()) from None
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise ConnectionError("the safety service ended the stream early")
        return verdict_from_pb(response)

    def _remember(self, verdict: SafetyVerdict) -> SafetyVerdict:
        if not verdict.allowed:
            self._halt = verdict
        return verdict

    def _degrade(self, mode: FailMode, reason: str) -> None:
        self.degraded = True
        self._call.cancel()
        CLIENT_FAILURES.labels("output", mode.value, reason).inc()
        log.warning("safety output filter unavailable (%s): failing %s for the rest of this stream", reason,
                    mode.value)

    async def close(self) -> None:
        """End the stream: half-close and wait briefly for the server; cancel if it does not answer."""
        if self._call.done():
            return
        try:
            async with asyncio.timeout(self._config.deadline_s(0)):
                await self._finish()
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            self._call.cancel()  # InvalidStateError: the call ended meanwhile (see `_exchange`)

    async def _finish(self) -> None:
        if self._halt is None:  # after a halt the server has already ended the stream
            await self._call.done_writing()
        while await self._call.read() is not grpc.aio.EOF:
            pass


class SafetyClient:
    """One channel per process; safe to share across the gateway's requests (one event loop)."""

    def __init__(self, address: str, config: SafetyClientConfig | None = None,
                 cluster_token: ClusterToken | None = None) -> None:
        self.address = address
        self.config = config or SafetyClientConfig()
        self._cluster_token = cluster_token  # the safety service refuses calls without it
        self._channel: grpc.aio.Channel | None = None
        self._stub: safety_pb2_grpc.SafetyStub | None = None

    def _safety(self) -> safety_pb2_grpc.SafetyStub:
        # Created on first use, inside the caller's event loop.
        if self._stub is None:
            self._channel = internal_channel(self.address, self._cluster_token)
            self._stub = safety_pb2_grpc.SafetyStub(self._channel)
        return self._stub

    async def check_input(self, org_id: str, text: str, request_id: str = "") -> SafetyVerdict:
        """The verdict on a prompt; allowed=False with tier "pattern"/"classifier": refuse it
        (finish_reason `content_filter`); tier "unavailable": the service did not answer.
        Raises InputTooLongError (no call) for a text longer than `limits.MAX_INPUT_CHARS`."""
        check_length(text)
        request = safety_pb2.CheckInputRequest(org_id=org_id, text=text, request_id=request_id)
        mode = self.config.input_fail_mode
        try:
            response = await self._safety().CheckInput(request, timeout=self.config.deadline_s(len(text)))
        except grpc.aio.AioRpcError as e:
            CLIENT_FAILURES.labels("input", mode.value, _reason(e)).inc()
            log.warning("safety check_input unavailable (%s): failing %s", _reason(e), mode.value)
            return unavailable_verdict(mode)
        return verdict_from_pb(response)

    async def open_output_filter(self, org_id: str, request_id: str, watch: bool = False) -> OutputFilter:
        """A post-filter stream for one generation (opening it does not wait for the service).
        `watch`: the prompt scored in the uncertain band; the service classifies this output more often."""
        return OutputFilter(self._safety().FilterOutput(), org_id, request_id, self.config, watch)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
