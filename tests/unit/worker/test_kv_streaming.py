"""KV streamed per prefill chunk, end to end in one process (decode service -> prefill service ->
memory transport): the tiny engine prefills PROMPT in chunks of 8 tokens (3 steps, 5 blocks of 4),
so the blocks of the first two chunks go as parts while the next chunk computes and the last part
carries the DONE notice. Tokens must equal the unstreamed path's and a local run's; every failure
frees every block on both workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
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
    prefill_service,
    prefill_servicer,
    tokens_of,
    transfer_config,
)

from engine.outputs import FinishReason
from kvtransfer.faults import Fault
from services.worker.config import TransferConfig
from services.worker.decode_jobs import GenerateEvent, GenerateJob, PrefillMode, PrefillPath
from services.worker.remote_prefill import FallbackReason

TIMEOUT_S = 10.0
STREAMED = transfer_config(stream_min_prompt_tokens=len(PROMPT))
UNSTREAMED = transfer_config(stream_kv=False)


class Pair:
    def __init__(self, prefill: Worker, decode: Worker, config: TransferConfig) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_service = prefill_service(prefill, config)
        stub = InProcessStub(prefill_servicer(prefill, self.prefill_service))
        self.service, _, self.peers = decode_service(decode, config, {PREFILL_ADDRESS: stub})
        self.parts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        write_part = prefill.link.write_part

        def record(rid: str, attempt: int, local: tuple[int, ...], remote: tuple[int, ...],
                   ready: torch.cuda.Event | None = None) -> None:
            self.parts.append((local, remote))
            write_part(rid, attempt, local, remote, ready)

        prefill.link.write_part = record  # type: ignore[method-assign]

    def generate(self, rid: str) -> AsyncIterator[GenerateEvent]:
        return self.service.generate(GenerateJob(rid, PROMPT, GREEDY, PrefillMode.REMOTE))

    async def all_free(self) -> bool:
        return await self.prefill.all_blocks_free() and await self.decode.all_blocks_free()

    async def close(self) -> None:
        self.service.abort_all()
        await self.service.wait_idle(TIMEOUT_S)
        self.prefill_service.abort_all()
        await self.prefill_service.wait_idle(TIMEOUT_S)
        await self.peers.close()


async def _open(prefill: Worker, decode: Worker, config: TransferConfig) -> AsyncIterator[Pair]:
    pair = Pair(prefill, decode, config)
    yield pair
    await pair.close()


@pytest.fixture
async def pair(prefill_worker: Worker, decode_worker: Worker) -> AsyncIterator[Pair]:
    async for p in _open(prefill_worker, decode_worker, STREAMED):
        yield p


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[int]:
    return build_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0]


async def test_streamed_kv_gives_the_unstreamed_and_local_tokens(prefill_worker: Worker, decode_worker: Worker,
                                                                 reference: list[int]) -> None:
    tokens = {}
    for name, config in (("streamed", STREAMED), ("unstreamed", UNSTREAMED)):
        async for pair in _open(prefill_worker, decode_worker, config):
            events = await asyncio.wait_for(drain_events(pair.generate(f"g-{name}")), TIMEOUT_S)
            assert (events[0].prefill_path, events[0].fallback_reason) == (PrefillPath.REMOTE, None)
            tokens[name] = tokens_of(events)
            assert len(pair.parts) == (2 if name == "streamed" else 0)  # chunks 1 and 2; chunk 3 finishes
            await eventually(pair.all_free)
    assert tokens["streamed"] == tokens["unstreamed"] == reference


async def test_the_parts_are_the_first_chunks_full_blocks_in_order(pair: Pair) -> None:
    await asyncio.wait_for(drain_events(pair.generate("g1")), TIMEOUT_S)
    (local1, remote1), (local2, remote2) = pair.parts
    assert len(local1) == len(local2) == 2  # 8 tokens = 2 blocks of 4 per chunk
    assert len(set(remote1 + remote2)) == 4


async def test_a_short_prompt_is_not_streamed(prefill_worker: Worker, decode_worker: Worker) -> None:
    config = transfer_config(stream_min_prompt_tokens=len(PROMPT) + 1)
    async for pair in _open(prefill_worker, decode_worker, config):
        events = await asyncio.wait_for(drain_events(pair.generate("g2")), TIMEOUT_S)
        assert events[0].prefill_path is PrefillPath.REMOTE and pair.parts == []


async def test_an_abort_mid_stream_frees_every_block_on_both_sides(pair: Pair) -> None:
    pair.prefill.gate.arm()  # stop after the first chunk's step: its part is queued on the link
    pair.prefill.agent.hold_writes(True)  # ... and stays in flight through the abort
    task = asyncio.create_task(drain_events(pair.generate("g3")))
    await pair.prefill.gate.paused()
    await eventually(lambda: len(pair.parts) == 1)
    assert await pair.service.abort("g3")
    pair.prefill.gate.release()
    await asyncio.sleep(0.05)
    assert not task.done()  # the decode side waits: a part may still land in its blocks
    pair.prefill.agent.hold_writes(False)
    events = await asyncio.wait_for(task, TIMEOUT_S)
    assert events[-1].output.finish_reason is FinishReason.ABORT
    await eventually(pair.all_free)


@pytest.mark.parametrize(("side", "fault", "reason"), [
    ("decode", Fault.CORRUPT_DESTINATION, FallbackReason.CHECKSUM_MISMATCH),  # a corrupted chunk
    ("prefill", Fault.FAIL_TRANSFER, FallbackReason.TRANSFER_FAILED),  # the first part fails
    ("prefill", Fault.STALL_TRANSFER, FallbackReason.TRANSFER_TIMEOUT),  # the first part never lands
])
async def test_a_failed_stream_recomputes_locally_and_frees_every_block(pair: Pair, reference: list[int],
                                                                       side, fault, reason) -> None:
    getattr(pair, side).faults.kv.arm(fault)
    events = await asyncio.wait_for(drain_events(pair.generate("g4")), TIMEOUT_S)
    assert (events[0].prefill_path, events[0].fallback_reason) == (PrefillPath.LOCAL_FALLBACK, reason)
    assert tokens_of(events) == reference
    await eventually(pair.all_free)


async def test_a_dead_decode_peer_ends_the_prefill_job_failed_with_its_blocks_free(pair: Pair) -> None:
    pair.prefill.gate.arm()
    task = asyncio.create_task(drain_events(pair.generate("g5")))
    await pair.prefill.gate.paused()
    pair.decode.agent.close()  # the decode worker's agent is gone (the process died)
    pair.prefill.gate.release()
    await eventually(lambda: pair.prefill_service.num_jobs == 0)
    await eventually(pair.prefill.all_blocks_free)
    task.cancel()
