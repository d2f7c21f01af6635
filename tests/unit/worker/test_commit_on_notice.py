"""The decode engine commits landed KV from any thread (the KV link's, on the DONE notice), and
never commits a request that was aborted meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path

from handoff_harness import build_engine

from engine.async_engine import AsyncEngine
from engine.remote_commit import COMMITTED, CommitOutcome, CommitStatus
from engine.sampling_params import SamplingParams

PROMPT = list(range(3, 40))
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


async def _reserved(tiny_model_dir: Path) -> tuple[AsyncEngine, int]:
    engine = AsyncEngine(build_engine(tiny_model_dir))
    reservation = await engine.reserve_remote("r", PROMPT, PARAMS, wants_remote=lambda cached: True)
    assert reservation.remote
    return engine, (await engine.status()).free_blocks


async def test_a_commit_queued_from_another_thread_streams_the_first_token(tiny_model_dir: Path) -> None:
    engine, _ = await _reserved(tiny_model_dir)
    try:
        stream = engine.open_stream("r")
        done = await asyncio.to_thread(engine.commit_remote_threadsafe, "r", 7, None, lambda: "")
        assert await asyncio.wrap_future(done) == COMMITTED
        first = await anext(stream)
        assert first.new_token_ids == (7,)
    finally:
        engine.shutdown()


async def test_a_failed_verification_commits_nothing(tiny_model_dir: Path) -> None:
    engine, free = await _reserved(tiny_model_dir)
    try:
        problem = await asyncio.wrap_future(engine.commit_remote_threadsafe("r", 7, None, lambda: "bad block 3"))
        status = await engine.status()
        assert problem == CommitOutcome(CommitStatus.REJECTED, "bad block 3")
        assert (status.num_waiting_for_remote_kv, status.num_running) == (1, 0)
        assert await engine.abort("r") and (await engine.status()).free_blocks > free
    finally:
        engine.shutdown()


async def test_a_request_aborted_before_its_notice_is_not_committed(tiny_model_dir: Path) -> None:
    engine, _ = await _reserved(tiny_model_dir)
    try:
        await engine.abort("r")
        verified: list[bool] = []
        outcome = await asyncio.wrap_future(
            engine.commit_remote_threadsafe("r", 7, None, lambda: verified.append(True) or ""))
        status = await engine.status()
        assert (outcome.status, verified, status.num_running, status.num_waiting_for_remote_kv) == (
            CommitStatus.ABORTED, [], 0, 0)
    finally:
        engine.shutdown()


async def test_a_verification_that_raises_is_a_failed_commit_not_a_mismatch(tiny_model_dir: Path) -> None:
    engine, _ = await _reserved(tiny_model_dir)

    def broken() -> str:
        raise RuntimeError("checksum kernel fell over")

    try:
        outcome = await asyncio.wrap_future(engine.commit_remote_threadsafe("r", 7, None, broken))
        status = await engine.status()
        assert outcome == CommitOutcome(CommitStatus.FAILED, "commit failed: checksum kernel fell over")
        assert (status.num_waiting_for_remote_kv, status.num_running) == (1, 0)  # still the caller's to abort
    finally:
        engine.shutdown()


async def test_a_reservation_waiting_for_its_kv_lets_the_loop_doze_until_the_commit_wakes_it(
        tiny_model_dir: Path) -> None:
    llm = build_engine(tiny_model_dir)
    steps = [0]
    real_step = llm.step

    def counted_step():  # the real step, counted
        steps[0] += 1
        return real_step()

    llm.step = counted_step  # type: ignore[method-assign]
    engine = AsyncEngine(llm)
    try:
        assert (await engine.reserve_remote("r", PROMPT, PARAMS, wants_remote=lambda cached: True)).remote
        await engine.status()  # a later command: the loop has seen the reservation
        before = steps[0]
        await asyncio.sleep(0.2)  # nothing can move without a command; a 2 ms tick stepped ~100 times here
        idle_steps = steps[0] - before
        stream = engine.open_stream("r")
        assert await asyncio.wrap_future(engine.commit_remote_threadsafe("r", 7, None, lambda: "")) == COMMITTED
        assert (await anext(stream)).new_token_ids == (7,)
    finally:
        engine.shutdown()
    assert idle_steps <= 10
