"""N-gram speculative decoding on this CPU machine: acceptance, tokens per step, speed-up vs off.

    python -m lab.micro.bench_speculative_cpu [--draft-tokens 4] [--max-tokens 96] [--repeats 2]
                                                   [--threads N] [--out results/speculative_cpu.json]

Workload: summarise / edit-this-text chat prompts on the default model (SmolLM2-135M-Instruct, float32),
greedy, EOS honoured (greedy output is identical with and without speculation, which the run checks,
so both sides generate the same tokens). Each run submits every prompt at once and steps the engine
until all finish. Runs alternate (off, on, off, on) and medians are reported, because this machine is
shared and noisy (CPU time of the process is reported too: other jobs disturb it less than wall time).
Reported per setting: generated tokens / wall time, engine steps, and with
speculation the acceptance rate (accepted / proposed drafts) and tokens per verify chunk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase funding for the public library by ten percent, to delay the road repairs "
    "until the spring, and to ask the council for a report on the cost of the new swimming pool.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "glucose and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, "
    "which contain the green pigment chlorophyll that absorbs the light.",
    "Our new release makes the service faster and easier to run. Requests are now routed by the expected "
    "cost of each prompt, the cache of recent prompts is shared between workers, and the dashboard shows "
    "the time to the first token and the time between tokens for every model.",
]
TASKS = [
    "Fix any spelling or grammar mistakes in the following text and return the full corrected text:\n\n{}",
    "Rewrite the following text in the past tense, keeping everything else the same:\n\n{}",
    "Summarise the following text in two sentences:\n\n{}",
]


def _prompts(tok) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": t.format(p)}]) for t in TASKS for p in PASSAGES]


def run_once(engine, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, num_draft_tokens=k)
    before = (engine.spec_stats.verify_chunks, engine.spec_stats.draft_tokens, engine.spec_stats.accepted_tokens)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    out: dict[str, list[int]] = {f"b{i}": [] for i in range(len(prompts))}
    steps, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        steps += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    s = engine.spec_stats
    verify, drafted, accepted = (s.verify_chunks - before[0], s.draft_tokens - before[1],
                                 s.accepted_tokens - before[2])
    tokens = sum(len(v) for v in out.values())
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "cpu_seconds": cpu, "steps": steps,
            "verify_chunks": verify, "draft_tokens": drafted, "accepted_tokens": accepted,
            "outputs": [out[f"b{i}"] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PASSAGES) * len(TASKS), help="how many of the 9 tasks")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 suffers far less from other jobs' threads")
    ap.add_argument("--out", type=Path, default=Path("results/speculative_cpu.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.prepare import default_model_dir

    engine = LLMEngine(EngineConfig(model=str(default_model_dir()), cache=CacheConfig(num_blocks=1024)))
    prompts = _prompts(engine.tokenizer)[:args.prompts]
    run_once(engine, prompts[:1], 4, args.draft_tokens)  # warm-up
    runs: dict[int, list[dict]] = {0: [], args.draft_tokens: []}
    for _ in range(args.repeats):
        for k in runs:
            runs[k].append(run_once(engine, prompts, args.max_tokens, k))
            r = runs[k][-1]
            print(f"k={k}: {r['tokens']} tokens in {r['seconds']:.1f}s ({r['tok_s']:.1f} tok/s, "
                  f"{r['cpu_seconds']:.1f} CPU-s), {r['steps']} steps", flush=True)
    off, on = runs[0], runs[args.draft_tokens]
    identical = all(a["outputs"] == b["outputs"] for a in off for b in on)
    drafted = sum(r["draft_tokens"] for r in on)
    accepted = sum(r["accepted_tokens"] for r in on)
    verify = sum(r["verify_chunks"] for r in on)
    summary = {
        "threads": torch.get_num_threads(), "prompts": len(prompts), "max_tokens": args.max_tokens,
        "draft_tokens": args.draft_tokens, "greedy_identical": identical,
        "off_tok_s": statistics.median(r["tok_s"] for r in off),
        "on_tok_s": statistics.median(r["tok_s"] for r in on),
        "off_steps": statistics.median(r["steps"] for r in off),
        "on_steps": statistics.median(r["steps"] for r in on),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verify_chunk": (accepted + verify) / verify if verify else 0.0,
    }
    summary["speedup"] = summary["on_tok_s"] / summary["off_tok_s"]
    # Each on-run against the off-run just before it: the two share the machine's load of the moment.
    summary["pair_speedups"] = [b["tok_s"] / a["tok_s"] for a, b in zip(off, on, strict=True)]
    summary["median_pair_speedup"] = statistics.median(summary["pair_speedups"])
    # CPU time of this process: less sensitive than wall time to other jobs on a shared machine.
    summary["cpu_time_speedup"] = (statistics.median(r["cpu_seconds"] for r in off)
                                   / statistics.median(r["cpu_seconds"] for r in on))
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for r in off + on:
        r.pop("outputs")
    args.out.write_text(json.dumps({"summary": summary, "off": off, "on": on}, indent=2))


if __name__ == "__main__":
    main()
