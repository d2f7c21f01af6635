"""Time prefill and decode steps on the serving engine's own model runner.

A step is timed exactly as the worker runs it: `runner.execute(plan)` on a `BatchPlan` (host
staging, the non-blocking copies, the eager forward or the captured CUDA graph, sampling and the
token read-back). Each timing takes block tables from the engine's block manager, so slots and
block tables are real, and gives its blocks back afterwards.

KV contents: a prefix that a prefill point reuses is prefilled for real first (untimed). Decode
contexts are set directly instead (the chunk starts at `context - 1`) over a pool filled with random
values once: prefilling 64 sequences of 4k tokens per point would take longer than the whole
profile, a decode step's time does not depend on the values it reads, and a zeroed pool would
flatter the kernels (lab/micro/bench_decode.py does the same).

Rounds: the grid is timed in interleaved rounds (every point once per round) and each point's time
is its median over the rounds. On a shared host a busy spell then slows one sample of many points,
which the medians drop, instead of every sample of a few neighbouring points, which would bend the
fit. On an idle GPU the order makes no difference.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.batch import BatchPlan, ScheduledChunk, StepResult
from engine.block_manager import BlockManager
from engine.errors import OutOfBlocksError
from engine.model_runner import ModelRunner
from engine.parallel.launcher import TensorParallelRunner
from engine.sampling_params import SamplingParams
from scheduler.calibration.points import DecodePoint, Measurements, PrefillPoint
from services.profiler.grid import ProfileGrid

Point = PrefillPoint | DecodePoint
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)  # argmax: the cheapest sampler path, no RNG state


class StepRunner(Protocol):
    """What the profiler needs of a model runner (`ModelRunner` or the tensor-parallel one)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 2  # untimed runs of each point first: Triton compiles and allocator growth land here
    repeats: int = 5  # timed rounds; a point's time is its median over them

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"need warmup >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")


class StepTimer:
    """Wall times of `runs` back-to-back steps of one point; None when its KV does not fit the pool."""

    def __init__(self, runner: StepRunner, blocks: BlockManager, vocab_size: int, device: torch.device,
                 seed: int = 0) -> None:
        self._runner = runner
        self._blocks = blocks
        self._vocab_size = vocab_size
        self._cuda = device.type == "cuda"
        self._rng = random.Random(seed)

    def time(self, point: Point, runs: int) -> list[float] | None:
        if isinstance(point, PrefillPoint):
            return self._time_prefill(point, runs)
        return self._time_decode(point, runs)

    def _time_prefill(self, point: PrefillPoint, runs: int) -> list[float] | None:
        tokens = self._random_tokens(point.cached_tokens + point.new_tokens)
        table = self._allocate(len(tokens))
        if table is None:
            return None
        try:
            if point.cached_tokens:
                self._execute(_chunk("prefix", tokens[:point.cached_tokens], 0, table, needs_sample=False))
            suffix = _chunk("prompt", tokens[point.cached_tokens:], point.cached_tokens, table, needs_sample=True)
            return self._wall_times(runs, suffix)
        finally:
            self._blocks.free(table)

    def _time_decode(self, point: DecodePoint, runs: int) -> list[float] | None:
        tables: list[list[int]] = []
        try:
            for _ in range(point.batch):
                table = self._allocate(point.context_per_seq)
                if table is None:
                    return None
                tables.append(table)
            tokens = self._random_tokens(point.batch)
            chunks = [_chunk(f"seq{i}", [tokens[i]], point.context_per_seq - 1, table, needs_sample=True)
                      for i, table in enumerate(tables)]
            return self._wall_times(runs, *chunks)
        finally:
            for table in tables:
                self._blocks.free(table)

    def _allocate(self, num_tokens: int) -> list[int] | None:
        table: list[int] = []
        try:
            self._blocks.append_slots(table, num_tokens)
        except OutOfBlocksError:
            return None
        return table

    def _wall_times(self, runs: int, *chunks: ScheduledChunk) -> list[float]:
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            self._execute(*chunks)
            samples.append(time.perf_counter() - start)
        return samples

    def _execute(self, *chunks: ScheduledChunk) -> None:
        self._runner.execute(BatchPlan(tuple(chunks)))
        if self._cuda:  # the token read-back already waits; this also covers a step that samples nothing,
            torch.cuda.synchronize()  # and leaves the device idle for the next step's clock

    def _random_tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self._vocab_size) for _ in range(n)]


def measure_grid(timer: StepTimer, grid: ProfileGrid, timing: TimingConfig,
                 on_progress: Callable[[str], None]) -> Measurements:
    """Warm every point up (which also finds those whose KV does not fit), then time the rest in
    interleaved rounds (see the module docstring)."""
    points: list[Point] = [*grid.prefill, *grid.decode]
    skipped = [p for p in points if timer.time(p, timing.warmup) is None]
    runnable = [p for p in points if p not in skipped]
    samples: dict[Point, list[float]] = {p: [] for p in runnable}
    for round_ in range(timing.repeats):
        for p in runnable:
            samples[p] += timer.time(p, 1) or []
        on_progress(f"round {round_ + 1}/{timing.repeats}: {len(runnable)} points")
    return _measurements({p: statistics.median(s) for p, s in samples.items()}, skipped)


def remeasure(timer: StepTimer, measured: Measurements, points: Sequence[Point], repeats: int) -> Measurements:
    """Time `points` again and keep the faster median of the two: contention on a shared host only
    ever adds time, so the faster one is closer to the step's own cost."""
    seconds: dict[Point, float] = {}
    seconds.update(measured.prefill)
    seconds.update(measured.decode)
    for p in points:
        again = timer.time(p, repeats)
        if again:
            seconds[p] = min(seconds[p], statistics.median(again))
    return _measurements(seconds, list(measured.skipped))


def _measurements(seconds: dict[Point, float], skipped: list[Point]) -> Measurements:
    """Split per-point times back into the two phases, in the order they were given."""
    return Measurements(
        prefill=tuple((p, s) for p, s in seconds.items() if isinstance(p, PrefillPoint)),
        decode=tuple((p, s) for p, s in seconds.items() if isinstance(p, DecodePoint)),
        skipped=tuple(skipped),
    )


def fill_kv_with_noise(runner: ModelRunner | TensorParallelRunner, seed: int) -> None:
    """Random values in the whole KV pool, on every tensor-parallel rank (see the module docstring)."""
    runner.randomize_kv_cache(seed)


def _chunk(request_id: str, token_ids: list[int], start_pos: int, table: list[int],
           needs_sample: bool) -> ScheduledChunk:
    return ScheduledChunk(request_id=request_id, token_ids=tuple(token_ids), start_pos=start_pos,
                          block_ids=tuple(table), needs_sample=needs_sample, sampling=_GREEDY,
                          prompt_token_ids=token_ids, output_token_ids=())
