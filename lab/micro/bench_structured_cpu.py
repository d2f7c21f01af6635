"""Structured outputs on this CPU machine: the per-step cost of a json_schema constraint.

    python -m lab.micro.bench_structured_cpu [--batch 8] [--max-tokens 56] [--repeats 2]
                                                  [--out results/structured_cpu.json]

Workload: `--batch` different "describe a person" chat prompts on the default model (SmolLM2-135M-Instruct,
float32), greedy, submitted at once, stepped until all finish; once with no constraint and once with
every row constrained by the same JSON schema (llguidance, as `response_format` json_schema sends it).
The two batches run on two engines in one process, one step of each in turn (this machine is shared and
its load swings several-fold within a minute: only step-by-step interleaving compares like with like);
wall and process CPU time (which a preempted thread does not accrue) per step are reported, medians.

The figure is ms per decode step *while the whole batch is decoding* (the prefill step and the steps
after the first row finished are left out), so both sides time the same batch shape even though the
constrained rows stop as soon as their JSON is complete. Also reported: the host time llguidance takes
per step to bring the batch's matchers up to date and write the int32 bitmask (it runs on a background
thread while the forward pass runs), and the time to apply the mask to the logits. Every constrained
output is checked against the schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                     "minItems": 2, "maxItems": 4}}}
PEOPLE = ["a retired teacher", "a young painter", "a ship captain", "a night-shift nurse", "a chess champion",
          "a beekeeper", "a jazz drummer", "a mountain guide", "a baker", "a software engineer"]


def _prompts(tok, batch: int) -> list[list[int]]:
    asks = [f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON with name, age, city and hobbies." for i in range(batch)]
    return [tok.encode_chat([{"role": "user", "content": a}]) for a in asks]


class MaskTimer:
    """Wraps the sampler's grammar compiler and `apply_token_bitmask` to add up their host time."""

    def __init__(self, engine) -> None:
        import engine.sampler as sampler_module

        self.compute_s = self.apply_s = 0.0
        grammar = engine.runner.sampler.grammar
        compute, apply = grammar.compute, sampler_module.apply_token_bitmask

        def timed_compute(chunks):
            t = time.perf_counter()
            try:
                return compute(chunks)
            finally:
                self.compute_s += time.perf_counter() - t

        def timed_apply(logits, mask):
            t = time.perf_counter()
            try:
                return apply(logits, mask)
            finally:
                self.apply_s += time.perf_counter() - t

        grammar.compute = timed_compute
        sampler_module.apply_token_bitmask = timed_apply


def _submit(engine, prompts: list[list[int]], max_tokens: int, constrained: bool) -> list[str]:
    from engine.sampling_params import SamplingParams
    from engine.structured import GrammarKind, GuidedDecoding

    ids = [f"{'j' if constrained else 'f'}{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        guided = GuidedDecoding(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)) if constrained else None
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=guided))
    return ids


class Side:
    """One engine's batch in a paired run: its outputs and its timed full-batch decode steps."""

    def __init__(self, engine, ids: list[str]) -> None:
        self.engine, self.ids = engine, ids
        self.out: dict[str, list[int]] = {rid: [] for rid in ids}
        self.running, self.steps = len(ids), 0
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, timed: bool) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = self.engine.step()
        if timed:
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu)
        for o in outputs:
            self.out[o.request_id].extend(o.new_token_ids)
            self.running -= o.finished
        self.steps += 1

    def full(self) -> bool:
        return self.running == len(self.ids)


def run_pair(free_engine, json_engine, timer: MaskTimer, prompts: list[list[int]], max_tokens: int) -> dict:
    """Both batches at once, one step of each in turn, so the shared machine's load hits both alike.
    Only steps taken while both batches are whole and past their prefill are timed."""
    free = Side(free_engine, _submit(free_engine, prompts, max_tokens, False))
    guided = Side(json_engine, _submit(json_engine, prompts, max_tokens, True))
    timer.compute_s = timer.apply_s = 0.0
    while free.engine.has_unfinished() or guided.engine.has_unfinished():
        timed = free.steps > 0 and guided.steps > 0 and free.full() and guided.full()
        for side in (free, guided):
            if side.engine.has_unfinished():
                side.step(timed)
    texts = [json_engine.tokenizer.decode(guided.out[rid], skip_special_tokens=True) for rid in guided.ids]
    return {"paired_steps": len(free.wall),
            "free_ms_per_step": 1000 * statistics.median(free.wall),
            "json_ms_per_step": 1000 * statistics.median(guided.wall),
            "free_cpu_ms_per_step": 1000 * statistics.median(free.cpu),
            "json_cpu_ms_per_step": 1000 * statistics.median(guided.cpu),
            "mask_ms_per_step": 1000 * timer.compute_s / guided.steps,
            "apply_ms_per_step": 1000 * timer.apply_s / guided.steps, "texts": texts}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=56)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("results/structured_cpu.json"))
    args = ap.parse_args()

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.prepare import default_model_dir

    def new_engine():
        return LLMEngine(EngineConfig(model=str(default_model_dir()), cache=CacheConfig(num_blocks=512)))

    free_engine, json_engine = new_engine(), new_engine()
    timer = MaskTimer(json_engine)
    prompts = _prompts(json_engine.tokenizer, args.batch)
    run_pair(free_engine, json_engine, timer, prompts[:1], 4)  # warm-up: builds llguidance's tokenizer (~1 s)
    runs = []
    for _ in range(args.repeats):
        r = run_pair(free_engine, json_engine, timer, prompts, args.max_tokens)
        runs.append(r)
        print(f"{r['paired_steps']} paired steps: free {r['free_ms_per_step']:.1f} ms "
              f"(cpu {r['free_cpu_ms_per_step']:.1f}), json {r['json_ms_per_step']:.1f} ms "
              f"(cpu {r['json_cpu_ms_per_step']:.1f}); mask {r['mask_ms_per_step']:.2f} ms/step, "
              f"apply {r['apply_ms_per_step']:.2f}", flush=True)
    keys = ["free_ms_per_step", "json_ms_per_step", "free_cpu_ms_per_step", "json_cpu_ms_per_step",
            "mask_ms_per_step", "apply_ms_per_step"]
    summary = {"threads": torch.get_num_threads(), "batch": args.batch, "max_tokens": args.max_tokens,
               "repeats": args.repeats, **{k: statistics.median(r[k] for r in runs) for k in keys},
               "json_valid": sum(_valid(t) for r in runs for t in r["texts"]),
               "json_outputs": sum(len(r["texts"]) for r in runs), "example": runs[0]["texts"][0]}
    summary["ratio"] = summary["json_ms_per_step"] / summary["free_ms_per_step"]
    summary["cpu_ratio"] = summary["json_cpu_ms_per_step"] / summary["free_cpu_ms_per_step"]
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
