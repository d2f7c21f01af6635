"""Engine throughput on this CPU machine vs `transformers` `generate`, measured side by side.

    python -m lab.micro.bench_engine_cpu [--new-tokens 64] [--out results/engine_cpu.json]

Both sides run the default model (SmolLM2-135M-Instruct, float32) on the same prompts with EOS ignored,
so every request produces exactly `--new-tokens` tokens. Throughput = generated tokens / wall time of
the whole run (prefill included). At 16 requests, transformers runs one static left-padded batch; Baton
runs them as 16 concurrent requests through continuous batching. Runs alternate (baton, hf, baton, hf)
and the median is reported, because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis briefly.",
    "List three prime numbers.", "Who wrote Hamlet?", "Describe a cat in one sentence.",
    "What is 12 times 12?", "Give me a synonym for happy.", "Name a famous painting.",
    "Why do birds migrate?", "What is the boiling point of water?", "Suggest a name for a dog.",
    "How many continents are there?", "What does a compiler do?", "Tell me a fun fact.",
    "What is the speed of light?",
]


def _prompts(tok, n: int) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]


def bench_baton(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o) == new_tokens for o in outs)
    return sum(len(o) for o in outs) / elapsed


@torch.inference_mode()
def bench_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    return generated / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", type=Path, default=Path("results/engine_cpu.json"))
    args = ap.parse_args()

    import transformers

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader.prepare import default_model_dir

    model_dir = default_model_dir()
    engine = LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=1024)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = engine.tokenizer.eos_token_ids[0]
    results = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "new_tokens": args.new_tokens, "runs": {}}
    for n in args.concurrency:
        prompts = _prompts(engine.tokenizer, n)
        bench_baton(engine, prompts, 4)  # warm-up both
        bench_hf(hf, prompts, 4, pad_id)
        baton, hf_tps = [], []
        for _ in range(args.repeats):
            baton.append(bench_baton(engine, prompts, args.new_tokens))
            hf_tps.append(bench_hf(hf, prompts, args.new_tokens, pad_id))
        b, h = statistics.median(baton), statistics.median(hf_tps)
        results["runs"][str(n)] = {"baton_tok_s": b, "hf_tok_s": h, "ratio": b / h,
                                   "baton_all": baton, "hf_all": hf_tps}
        print(f"concurrency {n:>3}: baton {b:8.1f} tok/s   transformers {h:8.1f} tok/s   ratio {b / h:5.2f}x",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
