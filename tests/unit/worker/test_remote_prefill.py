"""RemotePrefill: one attempt's end, decided by the KV link's notice and the Prefill RPC (an
in-process stub with the generated stub's call shape), and whether the blocks are safe afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from handoff_harness import (
    GREEDY,
    PREFILL_ADDRESS,
    PROMPT,
    FakeContext,
    InProcessPeers,
    InProcessStub,
    Worker,
    build_engine,
    eventually,
    prefill_service,
    prefill_servicer,
    transfer_config,
)

from kvtransfer.faults import Fault
from rpcgen.baton.v1 import worker_pb2 as pb
from services.worker.faults import DELAY_PREFILL
from services.worker.remote_prefill import KV_IDLE_TRAILER, AttemptResult, FallbackReason, RemotePrefill
from services.worker.servicer import WorkerServicer

IDLE = ((KV_IDLE_TRAILER, "1"),)
BLOCKS = tuple(range(40, 46))  # the decode side's reservation: 20 prompt tokens + the first token's slot
TIMEOUT_S = 5.0


class Scripted:
    """A servicer whose Prefill is replaced; Handshake and Abort go to the real one."""

    def __init__(self, real: WorkerServicer) -> None:
        self.real = real
        self.answer = asyncio.Event()  # HeldAnswer: set to let the Prefill RPC answer

    async def Handshake(self, request, context):  # noqa: N802
        return await self.real.Handshake(request, context)

    async def Abort(self, request, context):  # noqa: N802
        return await self.real.Abort(request, context)

    async def Prefill(self, request, context):  # noqa: N802
        return await self.real.Prefill(request, context)


class HeldAnswer(Scripted):
    """The real prefill (WRITE and notice included), but its answer waits for `answer`."""

    async def Prefill(self, request, context):  # noqa: N802
        response = await self.real.Prefill(request, context)
        await self.answer.wait()
        return response


class Failing(Scripted):
    """Never prefills: ends the RPC with `code`, vouching (idle trailer) or not that nothing will land."""

    def __init__(self, real: WorkerServicer, code: grpc.StatusCode, idle: bool) -> None:
        super().__init__(real)
        self.code, self.idle = code, idle

    async def Prefill(self, request, context: FakeContext):  # noqa: N802
        await context.abort(self.code, "scripted failure", IDLE if self.idle else ())


class DoneWithoutWriting(Scripted):
    """Claims DONE without a WRITE and without the idle trailer (e.g. a confused or dying peer)."""

    async def Prefill(self, request, context):  # noqa: N802
        return pb.PrefillResponse(request_id=request.request_id, outcome=pb.TRANSFER_OUTCOME_DONE, first_token_id=1)


class RealThenUnavailable(Scripted):
    """The real prefill runs to its end, then the RPC is lost (UNAVAILABLE, no trailer)."""

    async def Prefill(self, request, context):  # noqa: N802
        await self.real.Prefill(request, FakeContext())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")


@dataclass
class Attempt:
    prefill: Worker
    decode: Worker
    real: WorkerServicer

    async def run(self, servicer: Scripted | None = None, aborted: asyncio.Event | None = None,
                  rid: str = "r@0") -> tuple[AttemptResult, InProcessStub, InProcessPeers]:
        stub = InProcessStub(servicer or Scripted(self.real))
        peers = InProcessPeers({PREFILL_ADDRESS: stub}, self.decode.link)
        peer = peers.candidates()[0]
        await peers.connect(peer)
        remote = RemotePrefill(self.decode.link, peers, transfer_config(), 4)
        order = remote.order(rid, 0, PROMPT, GREEDY, BLOCKS, 0)
        result = await asyncio.wait_for(remote.run(order, peer, aborted or asyncio.Event()), TIMEOUT_S)
        return result, stub, peers


@pytest.fixture
async def attempt(prefill_worker: Worker, decode_worker: Worker) -> AsyncIterator[Attempt]:
    service = prefill_service(prefill_worker, transfer_config())
    yield Attempt(prefill_worker, decode_worker, prefill_servicer(prefill_worker, service))
    service.abort_all()
    await service.wait_idle(TIMEOUT_S)


async def test_success_is_decided_by_the_notice_before_the_rpc_answers(attempt: Attempt, tiny_model_dir) -> None:
    held = HeldAnswer(attempt.real)
    result, stub, _ = await attempt.run(held)
    first = build_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0][0]
    assert (result.ok, result.first_token_id, result.blocks_safe) == (True, first, True)
    assert stub.calls == ["Handshake", "Prefill"] and not held.answer.is_set()  # still unanswered
    held.answer.set()
    # Released without waiting for the link's answer, yet before any later command: expecting the same
    # request again raises "already expected" unless the release reached the receiver first.
    await attempt.decode.link.expect("r@0", BLOCKS, time.monotonic() + TIMEOUT_S, 0)


@pytest.mark.parametrize(("code", "reason", "elsewhere"), [
    (grpc.StatusCode.UNAVAILABLE, FallbackReason.PREFILL_UNAVAILABLE, True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, FallbackReason.PREFILL_DEADLINE, True),
    (grpc.StatusCode.FAILED_PRECONDITION, FallbackReason.PREFILL_REJECTED, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, FallbackReason.PREFILL_OVERLOADED, True),
    (grpc.StatusCode.INTERNAL, FallbackReason.PREFILL_ERROR, False),
    (grpc.StatusCode.INVALID_ARGUMENT, FallbackReason.PREFILL_ERROR, False),
])
async def test_rpc_errors_map_to_fallback_reasons(attempt: Attempt, code, reason, elsewhere) -> None:
    result, _, peers = await attempt.run(Failing(attempt.real, code, idle=True))
    assert (result.fallback, result.retry_elsewhere, result.blocks_safe) == (reason, elsewhere, True)
    assert (peers.candidates() == []) is elsewhere  # a peer that may be dead or slow is skipped a while
    await attempt.decode.link.expect("r@0", BLOCKS, time.monotonic() + TIMEOUT_S, 0)  # vouched: released


async def test_an_rpc_error_without_the_idle_trailer_quarantines_the_blocks(attempt: Attempt) -> None:
    result, _, _ = await attempt.run(Failing(attempt.real, grpc.StatusCode.UNAVAILABLE, idle=False))
    assert (result.fallback, result.blocks_safe) == (FallbackReason.PREFILL_UNAVAILABLE, False)
    await eventually(lambda: attempt.decode.reclaimed == ["r@0"])  # once the quarantine expired


async def test_an_aborted_notice_fails_the_attempt_with_the_blocks_safe(attempt: Attempt) -> None:
    attempt.prefill.faults.kv.arm(Fault.FAIL_TRANSFER)
    result, _, _ = await attempt.run()
    assert (result.fallback, result.blocks_safe) == (FallbackReason.TRANSFER_FAILED, True)


async def test_the_aborted_notice_alone_makes_the_blocks_safe_when_the_rpc_is_lost(attempt: Attempt) -> None:
    attempt.prefill.faults.kv.arm(Fault.FAIL_TRANSFER)
    result, _, _ = await attempt.run(RealThenUnavailable(attempt.real))
    assert (result.fallback, result.blocks_safe) == (FallbackReason.PREFILL_UNAVAILABLE, True)


async def test_done_without_a_notice_times_out_and_quarantines(attempt: Attempt) -> None:
    result, _, _ = await attempt.run(DoneWithoutWriting(attempt.real))
    assert (result.fallback, result.blocks_safe) == (FallbackReason.TRANSFER_TIMEOUT, False)
    await eventually(lambda: attempt.decode.reclaimed == ["r@0"])


async def test_a_dropped_notice_after_a_vouched_done_answer_times_out_with_the_blocks_safe(attempt: Attempt) -> None:
    attempt.decode.faults.kv.arm(Fault.DROP_NOTIFICATION)
    result, _, _ = await attempt.run()
    assert (result.fallback, result.blocks_safe) == (FallbackReason.TRANSFER_TIMEOUT, True)


async def test_an_abort_asks_the_prefill_worker_to_stop_and_waits_for_its_answer(attempt: Attempt) -> None:
    attempt.prefill.faults.arm(DELAY_PREFILL, delay_s=30.0)
    aborted = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, aborted.set)
    result, stub, _ = await attempt.run(aborted=aborted)
    assert (result.aborted, result.blocks_safe, stub.calls) == (True, True, ["Handshake", "Prefill", "Abort"])
    assert await attempt.prefill.all_blocks_free()
