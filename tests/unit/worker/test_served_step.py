"""The engine loop reports each step's served time: everything the loop did since its previous step,
the client's token gap, without the time it dozed while idle (engine/async_engine.py); and the
worker's step samples carry it to the scheduler."""

from __future__ import annotations

import time
from pathlib import Path

from handoff_harness import build_engine

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStats
from rpcgen.baton.v1 import scheduler_pb2 as spb
from services.worker.heartbeat import TelemetryBuffer

PROMPT = list(range(3, 40))
IDLE_S = 0.3
SLOW_HOOK_S = 0.05


async def _run(engine: AsyncEngine, rid: str, max_tokens: int = 6) -> None:
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0), rid):
        pass


async def test_served_time_covers_the_loop_between_steps_but_not_its_idle_time(tiny_model_dir: Path) -> None:
    steps: list[StepStats] = []
    engine = AsyncEngine(build_engine(tiny_model_dir), on_step=steps.append)
    try:
        start = time.perf_counter()
        await _run(engine, "a")
        busy = time.perf_counter() - start
        first = len(steps)
        time.sleep(IDLE_S)  # the loop dozes: no step may count it
        await _run(engine, "b")
    finally:
        engine.shutdown()
    assert len(steps) > first > 1
    assert all(s.served_seconds is not None and s.seconds <= s.served_seconds < IDLE_S for s in steps)
    # One busy stretch: the served times add up to the loop's wall time, within it.
    assert sum(s.seconds for s in steps[:first]) <= sum(s.period_seconds for s in steps[:first]) <= busy


async def test_work_the_loop_does_between_steps_is_in_the_next_steps_served_time(tiny_model_dir: Path) -> None:
    steps: list[StepStats] = []

    def slow_hook(stats: StepStats) -> None:  # stands for any work between steps (emission, commands)
        steps.append(stats)
        if len(steps) == 2:
            time.sleep(SLOW_HOOK_S)

    engine = AsyncEngine(build_engine(tiny_model_dir), on_step=slow_hook)
    try:
        await _run(engine, "a")
    finally:
        engine.shutdown()
    assert steps[2].served_seconds is not None and steps[2].served_seconds >= SLOW_HOOK_S > steps[2].seconds


def test_a_bare_engines_step_reports_its_forward_time_and_samples_carry_the_served_time() -> None:
    bare = StepStats(prefill_tokens=0, attention_tokens_sq=0, decode_seqs=2, decode_context_tokens=50,
                     seconds=0.01)
    assert bare.period_seconds == 0.01
    buf = TelemetryBuffer()
    buf.add_step(bare)
    buf.add_step(StepStats(prefill_tokens=8, attention_tokens_sq=64, decode_seqs=0, decode_context_tokens=0,
                           seconds=0.01, served_seconds=0.013))
    decode, prefill = buf.take()[0]
    assert (decode.kind, decode.seconds) == (spb.StepSample.KIND_DECODE, 0.01)
    assert (prefill.kind, prefill.seconds) == (spb.StepSample.KIND_PREFILL, 0.013)
