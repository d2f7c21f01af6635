"""PrefillService on the real engine and the in-memory transport: every phase of a job, and what an
abort in each phase does. The held blocks are the WRITE's source: they go back to the engine only once
the WRITE is terminal, and without waiting for an engine step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from handoff_harness import (
    BLOCK_SIZE,
    GREEDY,
    PROMPT,
    Worker,
    build_engine,
    eventually,
    prefill_service,
    transfer_config,
)

from kvtransfer.base import LandedKV, TransferState
from kvtransfer.faults import Fault
from kvtransfer.integrity import LandedVerifier
from services.worker.faults import DELAY_PREFILL
from services.worker.kv_link import Arrival
from services.worker.prefill_order import PrefillOrder
from services.worker.prefill_service import PrefillResult, PrefillService

SHORT = PROMPT[:8]  # one prefill chunk: the step that computes it also finishes it
TIMEOUT_S = 5.0
HELD = -(-(len(PROMPT) + 1) // BLOCK_SIZE)  # a held prefill keeps its prompt's blocks + the first token's slot


@pytest.fixture
async def service(prefill_worker: Worker, decode_worker: Worker) -> AsyncIterator[PrefillService]:
    svc = prefill_service(prefill_worker, transfer_config())  # the prefill_worker fixture's config
    await svc.handshake(decode_worker.link.handshake_info)
    await decode_worker.link.accept_peer(prefill_worker.link.handshake_info)
    yield svc
    svc.abort_all()
    await svc.wait_idle(TIMEOUT_S)


async def _submit(service: PrefillService, decode: Worker, rid: str, prompt: list[int] = PROMPT,
                  ) -> tuple[asyncio.Task[PrefillResult], asyncio.Future[Arrival]]:
    """Expect the KV on the decode side (blocks 40.. of its pool), then start the job."""
    remote = tuple(range(40, 40 + -(-len(prompt) // BLOCK_SIZE)))
    arrival = await decode.link.expect(rid, remote, asyncio.get_running_loop().time() + 60, 0)
    job = PrefillOrder(rid, 0, prompt, GREEDY, remote, 0, decode.link.handshake_info.agent_name, 0.5)
    return asyncio.create_task(service.prefill(job)), arrival


def _reference_first_token(model_dir, prompt: list[int]) -> int:
    return build_engine(model_dir).generate([prompt], GREEDY)[0][0]


async def test_a_job_writes_the_prompt_kv_and_its_first_token(service, prefill_worker, decode_worker,
                                                             tiny_model_dir) -> None:
    task, arrival = await _submit(service, decode_worker, "p1")
    result = await asyncio.wait_for(task, TIMEOUT_S)
    landed = (await asyncio.wait_for(arrival, TIMEOUT_S)).landed
    first = _reference_first_token(tiny_model_dir, PROMPT)
    assert (result.state, result.first_token_id, result.transfer_bytes > 0) == (TransferState.DONE, first, True)
    assert isinstance(landed, LandedKV) and landed.payload.first_token_id == first
    assert LandedVerifier(decode_worker.llm.runner.kv_cache).problem(landed) == ""  # the checksums travelled
    await eventually(prefill_worker.all_blocks_free)


async def test_abort_while_delayed_cancels_before_the_engine_sees_it(service, prefill_worker, decode_worker) -> None:
    prefill_worker.faults.arm(DELAY_PREFILL, delay_s=30.0)
    task, _ = await _submit(service, decode_worker, "p2")
    await eventually(lambda: service.num_jobs == 1)
    # Not in the engine yet: the worker's report of queued prefill work counts it from here
    assert service.unsubmitted_prefill() == (len(PROMPT), 1)
    assert service.abort("p2")
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert (result.state, result.reason) == (TransferState.CANCELLED, "aborted before prefill")
    assert (await prefill_worker.status()).num_waiting == 0


async def test_abort_while_prefilling_frees_the_blocks_and_writes_nothing(service, prefill_worker,
                                                                        decode_worker) -> None:
    prefill_worker.gate.arm()
    task, _ = await _submit(service, decode_worker, "p3")  # 20 tokens: three chunks of 8
    await prefill_worker.gate.paused()  # after the first chunk
    assert service.unsubmitted_prefill() == (0, 0)  # in the engine: its pending count holds the rest
    assert service.abort("p3")
    await asyncio.sleep(0.01)  # the job queues the engine abort, applied before the next step
    prefill_worker.gate.release()
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert (result.state, result.reason) == (TransferState.CANCELLED, "aborted during prefill")
    assert await prefill_worker.all_blocks_free()
    assert not decode_worker.llm.runner.kv_cache[40:45].any()


async def test_abort_once_held_releases_the_blocks_without_a_write(service, prefill_worker, decode_worker) -> None:
    prefill_worker.gate.arm()
    task, _ = await _submit(service, decode_worker, "p4", SHORT)
    await prefill_worker.gate.paused()  # the prefill is done, its blocks held, the output not yet out
    assert service.abort("p4")
    await asyncio.sleep(0.01)
    prefill_worker.gate.release()
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert (result.state, result.reason) == (TransferState.CANCELLED, "aborted after prefill")
    assert prefill_worker.link.num_inflight == 0 and not decode_worker.llm.runner.kv_cache[40:42].any()
    await eventually(prefill_worker.all_blocks_free)


async def test_abort_during_the_write_keeps_the_blocks_until_it_is_terminal(service, prefill_worker,
                                                                           decode_worker) -> None:
    prefill_worker.agent.hold_writes(True)  # the WRITE is posted and the transport will not let go
    task, arrival = await _submit(service, decode_worker, "p5")
    await eventually(lambda: prefill_worker.link.num_inflight == 1)
    assert service.abort("p5")
    await asyncio.sleep(0.05)
    assert not task.done() and (await prefill_worker.status()).held_blocks == HELD  # the source is still read
    prefill_worker.agent.hold_writes(False)
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert result.state is TransferState.DONE  # the WRITE finished first: the decode side got its KV
    assert (await asyncio.wait_for(arrival, TIMEOUT_S)).state is TransferState.DONE
    await eventually(prefill_worker.all_blocks_free)


async def test_abort_of_a_stalled_write_cancels_it_and_tells_the_decode_side(service, prefill_worker,
                                                                            decode_worker) -> None:
    prefill_worker.faults.kv.arm(Fault.STALL_TRANSFER)
    task, arrival = await _submit(service, decode_worker, "p6")
    await eventually(lambda: prefill_worker.link.num_inflight == 1)
    assert service.abort("p6")
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert result.state is TransferState.CANCELLED
    failure = await asyncio.wait_for(arrival, TIMEOUT_S)
    assert failure.state is TransferState.FAILED and "aborted" in failure.reason
    await eventually(prefill_worker.all_blocks_free)


async def test_the_answer_does_not_wait_for_an_engine_step_to_release_the_blocks(service, prefill_worker,
                                                                                decode_worker) -> None:
    prefill_worker.agent.hold_writes(True)
    task, _ = await _submit(service, decode_worker, "p7")
    await eventually(lambda: prefill_worker.link.num_inflight == 1)
    prefill_worker.gate.arm()
    other = asyncio.create_task(_drain(prefill_worker.engine.generate(SHORT, GREEDY, "busy")))
    await prefill_worker.gate.paused()  # the engine thread is now stuck inside a step
    prefill_worker.agent.hold_writes(False)
    result = await asyncio.wait_for(task, TIMEOUT_S)  # answered while the engine cannot step
    assert result.state is TransferState.DONE and prefill_worker.llm.num_held_blocks == HELD
    prefill_worker.gate.release()
    await asyncio.wait_for(other, TIMEOUT_S)
    await eventually(prefill_worker.all_blocks_free)


async def test_a_prefill_arriving_after_its_abort_is_refused(service, decode_worker) -> None:
    assert service.abort("p8") is False  # unknown yet: remembered
    task, _ = await _submit(service, decode_worker, "p8")
    result = await asyncio.wait_for(task, TIMEOUT_S)
    assert (result.state, result.reason) == (TransferState.CANCELLED, "aborted before it arrived")


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass
