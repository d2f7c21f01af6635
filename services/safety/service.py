"""`SafetyService`: the gRPC edge of the safety service (grpc.aio servicer).

CheckInput is unary: one text (a message of any role), one verdict. FilterOutput is one
bidirectional stream per generation: the gateway sends each detokenized delta and reads one verdict
per delta, in order; the server ends the stream after a halting verdict. A stream holds only its
sliding window (a few hundred characters), so thousands can be open at once.

The classifier tier (a sentence-encoder forward pass, milliseconds) runs in worker threads, never on
the event loop: the encoder releases the GIL, and the loop keeps answering pattern-tier verdicts of
other streams meanwhile. Three pools (`PoolSizes`), so that no check queues behind a longer kind of
work: short input texts, long input texts (over `limits.LONG_TEXT_CHARS`; a 5,000-word prompt is
seconds of CPU, and when short prompts queued behind one they missed their 1 s deadline and failed
closed), and output windows. With batching on (`batcher.py`; by default on a GPU encoder), the pools' threads
hand their texts to cross-request batchers and wait: windows and short prompts of many calls share one
encoder pass, long prompts have their own batcher. A check whose call deadline passes while its texts
queue is dropped (DEADLINE_EXCEEDED). A text over `limits.MAX_INPUT_CHARS` is refused
with INVALID_ARGUMENT before any work. Input check time by text size is in
`baton_safety_input_check_seconds{size}`.

Texts are never logged, only request ids, categories and tiers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from rpcgen.baton.v1 import safety_pb2, safety_pb2_grpc
from services.safety.batcher import BatchDeadlineError, Lane, call_scope
from services.safety.categories import Category, Detector, Direction, SafetyVerdict
from services.safety.checker import SafetyChecker, decide
from services.safety.guard import GuardModelTier
from services.safety.limits import LONG_TEXT_CHARS, MAX_INPUT_CHARS, size_bucket
from services.safety.metrics import ACTIVE_STREAMS, INPUT_CHECK_SECONDS, RPC_LATENCY, record_verdict
from services.safety.stream_filter import OutputStreamFilter, StreamFilterConfig
from services.safety.wire import verdict_to_pb

log = logging.getLogger(__name__)

_CHECK_LATENCY = RPC_LATENCY.labels("CheckInput")
_CHUNK_LATENCY = RPC_LATENCY.labels("FilterOutput")


@dataclass(frozen=True)
class PoolSizes:
    """Threads that run checks (normalising, the pattern tier, the encoder). Unbatched, each thread runs
    its own encoder pass, so a few (the defaults) keep the CPU from oversubscription. Batched, a thread
    mostly waits for its batch, so the pools bound how many checks can share one: `BATCHED_POOLS`."""

    input: int = 2        # short input texts
    long_input: int = 1   # input texts over LONG_TEXT_CHARS
    output: int = 1       # output windows of open streams

    def __post_init__(self) -> None:
        if min(self.input, self.long_input, self.output) < 1:
            raise ValueError(f"safety thread pools need at least one thread each: {self}")


BATCHED_POOLS = PoolSizes(input=8, long_input=2, output=16)


class SafetyService(safety_pb2_grpc.SafetyServicer):
    def __init__(self, checker: SafetyChecker, stream_config: StreamFilterConfig | None = None,
                 guard: GuardModelTier | None = None, pools: PoolSizes | None = None) -> None:
        self._checker = checker
        self._guard = guard
        self._stream_config = stream_config or StreamFilterConfig()
        pools = pools or PoolSizes()
        self._input_pool = ThreadPoolExecutor(pools.input, thread_name_prefix="safety-input")
        self._long_input_pool = ThreadPoolExecutor(pools.long_input, thread_name_prefix="safety-long-input")
        self._output_pool = ThreadPoolExecutor(pools.output, thread_name_prefix="safety-output")

    @staticmethod
    async def _in_pool(pool: ThreadPoolExecutor, lane: Lane, context: grpc.aio.ServicerContext,
                       work: Callable[[], SafetyVerdict]) -> SafetyVerdict:
        """`work()` in `pool`, its encoder texts in `lane`, bounded by the call's deadline; DEADLINE_EXCEEDED
        when it passed while the texts queued (the caller has given up: their work is dropped)."""
        remaining = context.time_remaining()

        def bounded() -> SafetyVerdict:
            with call_scope(lane, remaining):
                return work()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, bounded)
        except BatchDeadlineError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
            raise  # unreachable: abort raises

    async def CheckInput(self, request: safety_pb2.CheckInputRequest,
                         context: grpc.aio.ServicerContext) -> safety_pb2.Verdict:
        start = time.perf_counter()
        chars = len(request.text)
        if chars > MAX_INPUT_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the text has {chars} characters; at most {MAX_INPUT_CHARS} are judged")
        long = chars > LONG_TEXT_CHARS
        verdict = await self._in_pool(
            self._long_input_pool if long else self._input_pool, Lane.LONG_INPUT if long else Lane.INPUT, context,
            functools.partial(self._checker.check, request.org_id, request.text, Direction.INPUT))
        if self._guard is not None and verdict.allowed and verdict.category is None and verdict.tier != Detector.NONE:
            verdict = await self._ask_guard(request.org_id, request.text) or verdict
        elapsed = time.perf_counter() - start
        _CHECK_LATENCY.observe(elapsed)
        INPUT_CHECK_SECONDS.labels(size_bucket(chars)).observe(elapsed)
        record_verdict(Direction.INPUT, verdict.allowed, verdict.category, verdict.tier)
        if verdict.category is not None or verdict.watch:
            log.info("input %s org=%s request=%s category=%s tier=%s score=%.2f",
                     "watched" if verdict.category is None else "flagged" if verdict.allowed else "refused",
                     request.org_id, request.request_id, verdict.category, verdict.tier, verdict.score)
        return verdict_to_pb(verdict)

    async def _ask_guard(self, org_id: str, text: str) -> SafetyVerdict | None:
        """The guard tier's verdict when it answers "unsafe" in a category the policy checks on input."""
        assert self._guard is not None
        answer = await self._guard.judge(text)
        if answer is None or not answer.unsafe:
            return None
        policy = self._checker.policies.for_org(org_id)
        active = policy.active(Direction.INPUT)
        hit: Category | None = next((c for c in answer.categories if c in active), None)
        return None if hit is None else decide(policy, hit, 1.0, Detector.GUARD)

    async def FilterOutput(self, request_iterator: AsyncIterator[safety_pb2.OutputChunk],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[safety_pb2.Verdict]:
        ACTIVE_STREAMS.inc()
        stream: OutputStreamFilter | None = None
        last: SafetyVerdict | None = None
        org_id = request_id = ""
        try:
            async for chunk in request_iterator:
                start = time.perf_counter()
                if stream is None:
                    org_id, request_id = chunk.org_id, chunk.request_id
                    stream = OutputStreamFilter(self._checker, self._checker.policies.for_org(org_id),
                                                self._stream_config, watch=chunk.watch)
                if stream.needs_classifier(chunk.delta, chunk.final):
                    last = await self._in_pool(self._output_pool, Lane.OUTPUT, context,
                                               functools.partial(stream.feed, chunk.delta, chunk.final))
                else:
                    last = stream.feed(chunk.delta, chunk.final)
                _CHUNK_LATENCY.observe(time.perf_counter() - start)
                if last.category is not None:
                    record_verdict(Direction.OUTPUT, last.allowed, last.category, last.tier)
                    log.info("output %s org=%s request=%s category=%s tier=%s score=%.2f",
                             "flagged" if last.allowed else "halted", org_id, request_id, last.category,
                             last.tier, last.score)
                yield verdict_to_pb(last)
                if not last.allowed:
                    return
        finally:
            ACTIVE_STREAMS.dec()
            if last is not None and last.allowed and stream is not None and not stream.flagged:
                record_verdict(Direction.OUTPUT, True, None, last.tier)
