"""The decode worker's reservation and the Prefill RPC overlap (TransferConfig.overlap_reserve): the
Prefill RPC goes first with `destination_follows`, the prefill worker computes while the decode engine
reserves at its next step boundary, and the blocks follow in a PrefillDestination call. Nothing is
written before the destination; a withdrawn or never-placed job frees every block."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from handoff_harness import (
    BLOCK_SIZE,
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

from engine.sampling_params import SamplingParams
from kvtransfer.base import TransferState
from services.worker.config import TransferConfig
from services.worker.decode_jobs import GenerateEvent, GenerateJob, PrefillMode, PrefillPath
from services.worker.prefill_order import PrefillDestination, PrefillOrder
from services.worker.prefill_service import PrefillService

TIMEOUT_S = 10.0


class Pair:
    def __init__(self, prefill: Worker, decode: Worker, config: TransferConfig) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_service = prefill_service(prefill, config)
        self.stub = InProcessStub(prefill_servicer(prefill, self.prefill_service))
        self.service, _, self.peers = decode_service(decode, config, {PREFILL_ADDRESS: self.stub})

    def generate(self, rid: str, mode: PrefillMode = PrefillMode.REMOTE,
                 params: SamplingParams = GREEDY) -> AsyncIterator[GenerateEvent]:
        return self.service.generate(GenerateJob(rid, PROMPT, params, mode))

    async def all_free(self) -> bool:
        return await self.prefill.all_blocks_free() and await self.decode.all_blocks_free()

    async def close(self) -> None:
        self.service.abort_all()
        await self.service.wait_idle(TIMEOUT_S)
        self.prefill_service.abort_all()
        await self.prefill_service.wait_idle(TIMEOUT_S)
        await self.peers.close()


async def _open(prefill: Worker, decode: Worker, **config: object) -> AsyncIterator[Pair]:
    pair = Pair(prefill, decode, transfer_config(**config))
    yield pair
    await pair.close()


@pytest.fixture
async def pair(prefill_worker: Worker, decode_worker: Worker) -> AsyncIterator[Pair]:
    async for p in _open(prefill_worker, decode_worker):
        yield p


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[int]:
    return build_engine(tiny_model_dir).generate([PROMPT], GREEDY)[0]


async def test_the_destination_follows_the_prefill_rpc_with_the_local_tokens(pair: Pair, reference) -> None:
    events = await asyncio.wait_for(drain_events(pair.generate("o1")), TIMEOUT_S)
    assert (events[0].prefill_path, tokens_of(events)) == (PrefillPath.REMOTE, reference)
    assert pair.stub.calls == ["Handshake", "Prefill", "PrefillDestination"]
    await eventually(pair.all_free)


async def test_without_overlap_the_blocks_ride_in_the_prefill_rpc(prefill_worker: Worker, decode_worker: Worker,
                                                                 reference) -> None:
    async for pair in _open(prefill_worker, decode_worker, overlap_reserve=False):
        events = await asyncio.wait_for(drain_events(pair.generate("o2")), TIMEOUT_S)
        assert tokens_of(events) == reference and pair.stub.calls == ["Handshake", "Prefill"]


async def test_the_prefill_runs_while_the_reservation_waits_for_a_step_boundary(pair: Pair, reference) -> None:
    busy = asyncio.create_task(drain_events(pair.generate(
        "busy", PrefillMode.LOCAL, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))))
    await eventually(lambda: pair.service.num_flows == 1)
    pair.decode.gate.arm()  # the decode engine stops after its next step: no reservation meanwhile
    await pair.decode.gate.paused()
    task = asyncio.create_task(drain_events(pair.generate("o3")))
    await eventually(lambda: pair.prefill_service.num_jobs == 1)  # the prefill worker has it already
    assert pair.stub.calls[-1] == "Prefill"
    pair.decode.gate.release()
    events = await asyncio.wait_for(task, TIMEOUT_S)
    assert tokens_of(events) == reference and pair.stub.calls[-1] == "PrefillDestination"
    await asyncio.wait_for(busy, TIMEOUT_S)
    await eventually(pair.all_free)


async def test_a_prompt_the_decode_cache_serves_withdraws_the_asked_prefill(pair: Pair, reference) -> None:
    await asyncio.wait_for(drain_events(pair.generate("warm", PrefillMode.LOCAL)), TIMEOUT_S)  # now cached
    events = await asyncio.wait_for(drain_events(pair.generate("o4", PrefillMode.AUTO)), TIMEOUT_S)
    assert (events[0].prefill_path, tokens_of(events)) == (PrefillPath.LOCAL, reference)
    assert pair.stub.calls[-2:] == ["Prefill", "Abort"]
    await eventually(lambda: pair.prefill_service.num_jobs == 0)
    await eventually(pair.all_free)


def _order(decode: Worker, rid: str) -> PrefillOrder:
    return PrefillOrder(rid, 0, PROMPT, GREEDY, (), 0, decode.link.handshake_info.agent_name, 0.3,
                        destination_follows=True)


async def _service(prefill: Worker, decode: Worker) -> PrefillService:
    service = prefill_service(prefill, transfer_config())
    await service.handshake(decode.link.handshake_info)
    await decode.link.accept_peer(prefill.link.handshake_info)
    return service


async def test_a_destination_ahead_of_its_prefill_is_kept_for_it(prefill_worker: Worker,
                                                                 decode_worker: Worker) -> None:
    service = await _service(prefill_worker, decode_worker)
    remote = tuple(range(40, 40 + -(-len(PROMPT) // BLOCK_SIZE)))
    arrival = await decode_worker.link.expect("o5", remote, asyncio.get_running_loop().time() + 60, 0)
    assert service.place(PrefillDestination("o5", 0, remote, 0)) == ""  # before the Prefill: kept
    result = await asyncio.wait_for(service.prefill(_order(decode_worker, "o5")), TIMEOUT_S)
    assert result.state is TransferState.DONE
    assert (await asyncio.wait_for(arrival, TIMEOUT_S)).state is TransferState.DONE
    await eventually(prefill_worker.all_blocks_free)


async def test_a_job_that_never_gets_its_destination_fails_and_frees_its_blocks(prefill_worker: Worker,
                                                                                decode_worker: Worker) -> None:
    service = await _service(prefill_worker, decode_worker)
    result = await asyncio.wait_for(service.prefill(_order(decode_worker, "o6")), TIMEOUT_S)
    assert (result.state, result.reason) == (TransferState.FAILED, "no destination from the decode worker")
    assert not decode_worker.llm.runner.kv_cache.any()  # nothing was written anywhere
    await eventually(prefill_worker.all_blocks_free)


async def test_a_destination_that_does_not_fit_the_prompt_is_refused(prefill_worker: Worker,
                                                                     decode_worker: Worker) -> None:
    service = await _service(prefill_worker, decode_worker)
    task = asyncio.create_task(service.prefill(_order(decode_worker, "o7")))
    await eventually(lambda: service.num_jobs == 1)
    with pytest.raises(ValueError, match="remote_block_ids has 2 ids"):
        service.place(PrefillDestination("o7", 0, (40, 41), 0))
    assert service.place(PrefillDestination("o7", 1, (40, 41, 42, 43, 44), 0)).startswith("job 'o7' attempt 0")
    service.abort("o7")
    assert (await asyncio.wait_for(task, TIMEOUT_S)).state is TransferState.CANCELLED
