"""DecodeService end to end in one process: decode worker -> RemotePrefill -> (in-process stub) ->
the prefill worker's servicer and PrefillService -> memory transport -> the decode worker's blocks.
Tokens are compared with a local run of the same tiny model; blocks are counted on both engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from handoff_harness import (
    GREEDY,
    PREFILL_ADDRESS,
    PROMPT,
    InProcessStub,
    Worker,
    build_engine,
    decode_service,
    drain_events,
    eventually,
    open_worker,
    prefill_service,
    prefill_servicer,
    tokens_of,
    transfer_config,
)

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from kvtransfer.faults import Fault
from services.worker.decode_jobs import GenerateEvent, GenerateJob, PrefillMode, PrefillPath
from services.worker.decode_service import DecodeService
from services.worker.faults import DELAY_PREFILL
from services.worker.prefill_service import PrefillService
from services.worker.remote_prefill import FallbackReason

TIMEOUT_S = 10.0


@dataclass
class Pair:
    prefill: Worker
    decode: Worker
    prefill_service: PrefillService
    service: DecodeService
    reference: list[int]  # PROMPT's tokens from a local run

    def generate(self, rid: str, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY,
                 mode: PrefillMode = PrefillMode.REMOTE) -> AsyncIterator[GenerateEvent]:
        return self.service.generate(GenerateJob(rid, prompt, params, mode))

    async def all_free(self) -> bool:
        return await self.prefill.all_blocks_free() and await self.decode.all_blocks_free()


async def _pair(prefill: Worker, decode: Worker, model_dir: Path) -> AsyncIterator[Pair]:
    config = transfer_config()
    psvc = prefill_service(prefill, config)
    stub = InProcessStub(prefill_servicer(prefill, psvc))
    service, _, peers = decode_service(decode, config, {PREFILL_ADDRESS: stub})
    yield Pair(prefill, decode, psvc, service, build_engine(model_dir).generate([PROMPT], GREEDY)[0])
    service.abort_all()
    await service.wait_idle(TIMEOUT_S)
    psvc.abort_all()
    await psvc.wait_idle(TIMEOUT_S)
    await peers.close()


@pytest.fixture
async def pair(prefill_worker: Worker, decode_worker: Worker, tiny_model_dir: Path) -> AsyncIterator[Pair]:
    async for p in _pair(prefill_worker, decode_worker, tiny_model_dir):
        yield p


async def test_a_remote_prefill_streams_the_local_runs_tokens_and_frees_every_block(pair: Pair) -> None:
    events = await asyncio.wait_for(drain_events(pair.generate("g1")), TIMEOUT_S)
    assert (events[0].prefill_path, events[0].fallback_reason) == (PrefillPath.REMOTE, None)
    assert tokens_of(events) == pair.reference and events[-1].output.finish_reason is FinishReason.LENGTH
    await eventually(pair.all_free)


@pytest.mark.parametrize(("side", "fault", "reason"), [
    ("decode", Fault.CORRUPT_DESTINATION, FallbackReason.CHECKSUM_MISMATCH),  # caught by the decode engine
    ("prefill", Fault.FAIL_TRANSFER, FallbackReason.TRANSFER_FAILED),  # ABORTED notice + outcome FAILED
])
async def test_a_failed_handoff_recomputes_locally_with_the_right_tokens(pair: Pair, side, fault, reason) -> None:
    getattr(pair, side).faults.kv.arm(fault)
    events = await asyncio.wait_for(drain_events(pair.generate("g2")), TIMEOUT_S)
    assert (events[0].prefill_path, events[0].fallback_reason) == (PrefillPath.LOCAL_FALLBACK, reason)
    assert tokens_of(events) == pair.reference
    assert pair.decode.metrics.registry.get_sample_value("baton_pd_fallback_total", {"reason": reason.value}) == 1
    await eventually(pair.all_free)


async def test_no_free_blocks_to_reserve_prefills_locally_once_blocks_free_up(prefill_worker: Worker,
                                                                             tiny_model_dir: Path) -> None:
    decode = await open_worker(tiny_model_dir, "decode", transfer_config(), num_blocks=8)  # 32 tokens
    try:
        async for pair in _pair(prefill_worker, decode, tiny_model_dir):
            decode.gate.arm()
            hog = asyncio.create_task(drain_events(pair.generate(
                "hog", PROMPT, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), PrefillMode.LOCAL)))
            await decode.gate.paused()  # after the hog's first step: 6 of the 8 blocks are its
            late = asyncio.create_task(drain_events(pair.generate("g4")))
            await asyncio.sleep(0.02)  # its reservation is queued behind the paused step
            decode.gate.release()
            events = await asyncio.wait_for(late, TIMEOUT_S)
            assert (events[0].prefill_path, events[0].fallback_reason) == (PrefillPath.LOCAL_FALLBACK,
                                                                           FallbackReason.DECODE_OUT_OF_BLOCKS)
            assert tokens_of(events) == pair.reference
            assert len(tokens_of(await asyncio.wait_for(hog, TIMEOUT_S))) == 10
            await eventually(pair.all_free)
    finally:
        await decode.close()


async def test_abort_while_the_prefill_worker_has_not_started_frees_every_block(pair: Pair) -> None:
    pair.prefill.faults.arm(DELAY_PREFILL, delay_s=30.0)
    stream = pair.generate("g5")
    task = asyncio.create_task(drain_events(stream))
    await eventually(lambda: pair.prefill_service.num_jobs == 1)
    assert (await pair.decode.status()).num_waiting_for_remote_kv == 1
    assert await pair.service.abort("g5")
    events = await asyncio.wait_for(task, TIMEOUT_S)
    assert events[-1].output.finish_reason is FinishReason.ABORT
    await eventually(pair.all_free)


async def test_abort_during_the_write_frees_every_block_once_it_is_over(pair: Pair) -> None:
    pair.prefill.agent.hold_writes(True)
    task = asyncio.create_task(drain_events(pair.generate("g6")))
    await eventually(lambda: pair.prefill.link.num_inflight == 1)
    assert await pair.service.abort("g6")
    await asyncio.sleep(0.05)
    assert not task.done() and (await pair.decode.status()).num_waiting_for_remote_kv == 1  # a WRITE may land
    pair.prefill.agent.hold_writes(False)
    events = await asyncio.wait_for(task, TIMEOUT_S)
    assert events[-1].output.finish_reason is FinishReason.ABORT
    await eventually(pair.all_free)


async def test_abort_while_decoding_frees_every_block(pair: Pair) -> None:
    stream = pair.generate("g7", params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    first = await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
    assert first.prefill_path is PrefillPath.REMOTE
    assert await pair.service.abort("g7")
    rest = await asyncio.wait_for(drain_events(stream), TIMEOUT_S)
    assert rest[-1].output.finish_reason is FinishReason.ABORT and len(tokens_of(rest)) < 199
    await eventually(pair.all_free)


async def test_a_client_leaving_mid_stream_aborts_the_request(pair: Pair) -> None:
    stream = pair.generate("g8", params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
    await stream.aclose()  # the gRPC stream was cancelled
    await eventually(lambda: pair.service.num_flows == 0)  # the flow saw the engine's ABORT and ended
    await eventually(pair.all_free)


async def test_each_request_counts_once_in_each_workers_intake_whatever_path_it_took(pair: Pair) -> None:
    """What heartbeats report as `requests_received` (services/worker/intake.py): the scheduler drops one
    reservation per counted request, so a fallback must not count the request again."""
    await asyncio.wait_for(drain_events(pair.generate("ok")), TIMEOUT_S)
    assert (pair.decode.intake.count, pair.prefill.intake.count) == (1, 1)
    pair.decode.faults.kv.arm(Fault.CORRUPT_DESTINATION)  # the hand-off fails: prefilled again locally
    events = await asyncio.wait_for(drain_events(pair.generate("fallback")), TIMEOUT_S)
    assert events[0].prefill_path is PrefillPath.LOCAL_FALLBACK
    assert (pair.decode.intake.count, pair.prefill.intake.count) == (2, 2)
    await asyncio.wait_for(drain_events(pair.generate("local", mode=PrefillMode.LOCAL)), TIMEOUT_S)
    assert (pair.decode.intake.count, pair.prefill.intake.count) == (3, 2)


async def test_a_request_the_intake_counts_is_in_the_next_engine_status(pair: Pair) -> None:
    """The count is read before the engine's status snapshot; the engine runs its commands in order, so
    whatever was counted is in the snapshot, even when the engine was mid-step when it arrived."""
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)  # still running at the pause
    hog = asyncio.create_task(drain_events(pair.generate("hog", PROMPT, long, PrefillMode.LOCAL)))
    await eventually(lambda: _running(pair))
    pair.decode.gate.arm()
    await pair.decode.gate.paused()  # mid-step: the next commands wait for its end
    late = asyncio.create_task(drain_events(pair.generate("late", mode=PrefillMode.LOCAL)))
    await eventually(lambda: _counted(pair, 2))
    counted = pair.decode.intake.count
    status = asyncio.create_task(pair.decode.status())
    pair.decode.gate.release()
    s = await asyncio.wait_for(status, TIMEOUT_S)
    assert counted == 2 and s.num_running + s.num_waiting == 2
    await asyncio.wait_for(asyncio.gather(hog, late), TIMEOUT_S)


async def _running(pair: Pair) -> bool:
    return (await pair.decode.status()).num_running == 1


async def _counted(pair: Pair, n: int) -> bool:
    return pair.decode.intake.count == n
