"""n > 1 through disaggregation, in one process (tests/unit/worker/handoff_harness.py): one Prefill for
all choices, the decode worker forks them from the landed KV, and each choice's tokens equal that
choice run alone on one engine; aborting one or all choices returns both pools to their baseline."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from handoff_harness import (
    PREFILL_ADDRESS,
    InProcessStub,
    Worker,
    build_engine,
    decode_service,
    drain_events,
    eventually,
    prefill_service,
    prefill_servicer,
    transfer_config,
)

from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from services.worker.decode_jobs import GenerateEvent, GenerateJob, JobChoice, PrefillMode, PrefillPath
from services.worker.decode_service import DecodeService

TIMEOUT_S = 10.0
PROMPT = [5, 17, 3, 88, 42, 7, 19, 60, 2, 9, 11, 13, 40, 41, 42, 99, 100, 7, 8, 21, 33]  # 5 blocks + 1 token
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, logprobs=2, seed=500)


def _params(i: int) -> SamplingParams:
    return dataclasses.replace(SAMPLED, seed=SAMPLED.seed + i)  # type: ignore[operator]


def _job(rid: str, n: int = 3, max_tokens: int = 6) -> GenerateJob:
    ps = [dataclasses.replace(_params(i), max_tokens=max_tokens) for i in range(n)]
    return GenerateJob(rid, PROMPT, ps[0], PrefillMode.REMOTE,
                       choices=tuple(JobChoice(f"{rid}-{i}", p) for i, p in enumerate(ps[1:], start=1)))


def _by_choice(events: list[GenerateEvent]) -> dict[str, list[GenerateEvent]]:
    out: dict[str, list[GenerateEvent]] = {}
    for e in events:
        out.setdefault(e.request_id, []).append(e)
    return out


@dataclasses.dataclass
class Pair:
    prefill: Worker
    decode: Worker
    service: DecodeService
    stub: InProcessStub

    async def all_free(self) -> bool:
        return await self.prefill.all_blocks_free() and await self.decode.all_blocks_free()


@pytest.fixture
async def pair(prefill_worker: Worker, decode_worker: Worker) -> AsyncIterator[Pair]:
    config = transfer_config()
    psvc = prefill_service(prefill_worker, config)
    stub = InProcessStub(prefill_servicer(prefill_worker, psvc))
    service, _, peers = decode_service(decode_worker, config, {PREFILL_ADDRESS: stub})
    yield Pair(prefill_worker, decode_worker, service, stub)
    service.abort_all()
    await service.wait_idle(TIMEOUT_S)
    psvc.abort_all()
    await psvc.wait_idle(TIMEOUT_S)
    await peers.close()


async def test_one_prefill_serves_every_choice_and_each_equals_its_choice_alone(pair: Pair,
                                                                                tiny_model_dir: Path) -> None:
    events = _by_choice(await asyncio.wait_for(drain_events(pair.service.generate(_job("n3"))), TIMEOUT_S))
    assert pair.stub.calls.count("Prefill") == 1
    assert set(events) == {"n3", "n3-1", "n3-2"}
    reference = build_engine(tiny_model_dir)
    texts = []
    for i, rid in enumerate(("n3", "n3-1", "n3-2")):
        got = events[rid]
        assert got[0].prefill_path is PrefillPath.REMOTE and got[-1].output.finish_reason is FinishReason.LENGTH
        tokens = [t for e in got for t in e.output.new_token_ids]
        assert tokens == reference.generate([PROMPT], _params(i))[0]
        assert [lp.token_id for e in got for lp in e.output.logprobs] == tokens
        texts.append(tuple(tokens))
    assert len(set(texts)) > 1
    await eventually(pair.all_free)


@pytest.mark.parametrize("aborted", [("ab-1",), ("ab",), ("ab", "ab-1", "ab-2")])
async def test_aborting_choices_frees_every_block(pair: Pair, aborted: tuple[str, ...]) -> None:
    stream = pair.service.generate(_job("ab", max_tokens=200))
    agen = stream.__aiter__()
    seen: list[GenerateEvent] = [await asyncio.wait_for(agen.__anext__(), TIMEOUT_S)]  # committed and running
    for rid in aborted:
        assert await pair.service.abort(rid)
    async for event in agen:
        seen.append(event)
    ends = {rid: evs[-1].output.finish_reason for rid, evs in _by_choice(seen).items()}
    assert all(ends[rid] is FinishReason.ABORT for rid in aborted)
    assert all(reason is FinishReason.LENGTH for rid, reason in ends.items() if rid not in aborted)
    await eventually(pair.all_free)


async def test_a_choice_aborted_before_the_commit_is_never_forked(pair: Pair) -> None:
    stream = pair.service.generate(_job("early"))
    agen = stream.__aiter__()
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0)  # the flow has started; the KV has not landed yet
    assert await pair.service.abort("early-2")
    seen = [await asyncio.wait_for(first, TIMEOUT_S)] + [e async for e in agen]
    ends = {rid: evs[-1].output.finish_reason for rid, evs in _by_choice(seen).items()}
    assert ends == {"early": FinishReason.LENGTH, "early-1": FinishReason.LENGTH, "early-2": FinishReason.ABORT}
    await eventually(pair.all_free)
