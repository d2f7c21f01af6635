"""Host time of one engine decode step, by phase and batch size, on a tiny model on the CPU.

    python -m lab.micro.bench_host_step [--batches 1 8 32 64] [--steps 64] [--out results/host_step.json]
    python -m lab.micro.bench_host_step --smoke --out /tmp/h.json    # seconds: checks the code paths

`LLMEngine.step` on a 2-layer, 64-wide Llama with dummy weights (torch attention, float32), B requests of
`--prompt-len` random tokens, greedy, EOS ignored. After the prefill step and a few warm-up decodes,
`--steps` decode steps are timed phase by phase (timers wrap the engine's own objects; no product code
changes for it):

    schedule     Batcher.schedule: the plan (block growth, chunks)
    prepare      ModelRunner.prepare_inputs: the eager step's host lists -> tensors
    forward      the model's forward and LM head: the part a GPU runs (excluded from host time)
    sample       Sampler.sample (on a GPU it ends in the step's one read of the sampled ids)
    execute      the rest of ModelRunner.execute (sampling rows, result dicts)
    postprocess  Batcher.postprocess: tokens appended, full blocks hashed
    emit         the rest of LLMEngine.step: step stats, stop checks, the per-request outputs
    host         step - forward: what a GPU run pays on the host besides launching its graph
    graph_stage  DecodeInputBuffers.load on the same plan, timed apart: what a CUDA-graph decode step
                 runs instead of `prepare` (the engine on a GPU takes that path)

The GPU-side host cost of a graph decode step is therefore host - prepare + graph_stage. Times are
medians over the timed steps, in ms per step. The tiny model keeps `forward` small; the other phases
do not depend on the model's size, only on the batch and the context.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

from engine.batch import BatchPlan
from engine.config import BatcherConfig, CacheConfig, EngineConfig
from engine.input_buffers import DecodeInputBuffers
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lab.micro.bench_decode import BLOCK, SMOKE, write_model_dir

P = ParamSpec("P")
R = TypeVar("R")
WARMUP_STEPS = 4


class Phase(Enum):
    STEP = "step"
    SCHEDULE = "schedule"
    EXECUTE = "execute_all"
    PREPARE = "prepare"
    FORWARD = "forward"
    SAMPLE = "sample"
    POSTPROCESS = "postprocess"
    GRAPH_STAGE = "graph_stage"


COLUMNS = ("schedule", "prepare", "forward", "sample", "execute", "postprocess", "emit", "host", "graph_stage",
           "graph_host")


@dataclass
class PhaseClock:
    """Seconds spent in each phase during the current step; `enabled` off while warming up."""

    enabled: bool = False
    current: dict[Phase, float] = field(default_factory=lambda: defaultdict(float))

    def wrap(self, phase: Phase, fn: Callable[P, R]) -> Callable[P, R]:
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start
        return timed

    def take(self) -> dict[Phase, float]:
        step, self.current = self.current, defaultdict(float)
        return step


@dataclass
class StepTimes:
    """One timed step's phases, in ms, as the report's columns."""

    ms: dict[str, float]

    @classmethod
    def of(cls, seconds: dict[Phase, float]) -> StepTimes:
        s = {p: seconds.get(p, 0.0) * 1e3 for p in Phase}
        forward = s[Phase.FORWARD]
        inner = s[Phase.PREPARE] + forward + s[Phase.SAMPLE]
        host = s[Phase.STEP] - forward
        return cls({
            "schedule": s[Phase.SCHEDULE], "prepare": s[Phase.PREPARE], "forward": forward,
            "sample": s[Phase.SAMPLE], "execute": s[Phase.EXECUTE] - inner, "postprocess": s[Phase.POSTPROCESS],
            "emit": s[Phase.STEP] - s[Phase.SCHEDULE] - s[Phase.EXECUTE] - s[Phase.POSTPROCESS],
            "host": host, "graph_stage": s[Phase.GRAPH_STAGE],
            "graph_host": host - s[Phase.PREPARE] + s[Phase.GRAPH_STAGE],
        })


def build_engine(batch: int, prompt_len: int, steps: int) -> LLMEngine:
    blocks = batch * -(-(prompt_len + steps + 2 * WARMUP_STEPS) // BLOCK) + 8
    return LLMEngine(EngineConfig(
        model=write_model_dir(SMOKE), load_format="dummy", dtype="float32", device="cpu",
        attention_backend="torch", seed=0,
        cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
        batcher=BatcherConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len)))


def instrument(engine: LLMEngine, clock: PhaseClock, plans: list[BatchPlan]) -> Callable[[], None]:
    """Wrap the engine's phases with `clock`; returns the step to call. `plans` gets each step's plan."""
    runner, batcher, model = engine.runner, engine.batcher, engine.runner.model
    schedule = clock.wrap(Phase.SCHEDULE, batcher.schedule)

    def schedule_and_keep() -> BatchPlan:
        plan = schedule()
        plans.append(plan)
        return plan

    batcher.schedule = schedule_and_keep  # type: ignore[method-assign]
    batcher.postprocess = clock.wrap(Phase.POSTPROCESS, batcher.postprocess)  # type: ignore[method-assign]
    runner.execute = clock.wrap(Phase.EXECUTE, runner.execute)  # type: ignore[method-assign]
    runner.prepare_inputs = clock.wrap(Phase.PREPARE, runner.prepare_inputs)  # type: ignore[method-assign]
    runner.sampler.sample = clock.wrap(Phase.SAMPLE, runner.sampler.sample)  # type: ignore[method-assign]
    model.forward = clock.wrap(Phase.FORWARD, model.forward)  # type: ignore[method-assign]
    model.compute_logits = clock.wrap(Phase.FORWARD, model.compute_logits)  # type: ignore[method-assign]
    return clock.wrap(Phase.STEP, engine.step)


def measure_batch(batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Median ms per decode step, per column, at `batch` sequences."""
    engine = build_engine(batch, prompt_len, steps)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 2 * WARMUP_STEPS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, SMOKE["vocab_size"], (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    clock, plans = PhaseClock(), []
    step = instrument(engine, clock, plans)
    staging = DecodeInputBuffers(batch, engine.runner.num_blocks, BLOCK, torch.device("cpu"))
    while engine.batcher.num_pending_prefill_requests:
        step()  # the prefill (one step when the budget holds every prompt)
    rows = []
    for i in range(WARMUP_STEPS + steps):
        step()
        plan = plans[-1]
        assert len(plan.chunks) == batch and all(c.num_tokens == 1 for c in plan.chunks), "not a pure decode step"
        clock.wrap(Phase.GRAPH_STAGE, staging.load)(plan.chunks, batch)
        seconds = clock.take()
        if i >= WARMUP_STEPS:
            rows.append(StepTimes.of(seconds))
    engine.shutdown()
    return {col: statistics.median(r.ms[col] for r in rows) for col in COLUMNS}


def format_table(results: dict[int, dict[str, float]]) -> str:
    head = "| batch | " + " | ".join(COLUMNS) + " |"
    rule = "|" + "---|" * (len(COLUMNS) + 1)
    lines = [f"| {b} | " + " | ".join(f"{r[c]:.3f}" for c in COLUMNS) + " |" for b, r in results.items()]
    return "\n".join([head, rule, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/host_step.json"))
    parser.add_argument("--smoke", action="store_true", help="2 batches, 4 steps: checks the code paths")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.steps, args.prompt_len = [1, 4], 4, 20
    torch.set_num_threads(1)  # the host side is one Python thread; keep the tiny forward from fanning out
    results = {b: measure_batch(b, args.prompt_len, args.steps) for b in args.batches}
    print(format_table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                    "steps": args.steps, "prompt_len": args.prompt_len,
                                    "rows": [{"batch": b, **r} for b, r in results.items()]}, indent=2))


if __name__ == "__main__":
    main()
