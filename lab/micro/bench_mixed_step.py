"""What a step that carries a prompt and the running decodes costs on the CUDA engine, against the two apart.

    python -m lab.micro.bench_mixed_step --out mixed.json
    python -m lab.micro.bench_mixed_step --smoke --out /tmp/m.json    # CPU: code paths only

Chunked prefill folds a prompt (or a chunk of one) into the decode batch's step. The scheduler prices
such a step as prefill + s x decode step (scheduler/core/cost_model.py, mixed steps) and fits s online
from the workers' mixed samples; the planner's simulated GPU workers take s from their spec
(scheduler/sim/spec.py `mixed_decode_share`). On a CPU worker one forward pass carries both and s
came out ~0.3; this measures it on a GPU, where the decode step alone replays a CUDA graph and a mixed
step runs eagerly.

Model: Llama-3.1-8B's shape with dummy bf16 weights (bench_decode.py). For each decode batch B (every
sequence at context `--ctx`, over shuffled blocks) and prompt chunk P (a fresh sequence from
position 0): the median step time of the decode batch alone, the chunk alone, and the two in one
step (`runner.execute` of one plan, the engine's own path for a mixed batch). Reported:
share = (mixed - chunk) / decode, the s above; and mixed / (chunk + decode), what running them in one
step saves. The decode and chunk rows are timed in the same run, beside the copy and matmul ceilings.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from engine.batch import BatchPlan, ScheduledChunk
from lab.micro.bench_decode import (
    BLOCK,
    GREEDY,
    LLAMA31_8B,
    SMOKE,
    bench_engine_config,
    decode_plan,
    environment,
    measure_ceilings,
    median_ms,
    write_model_dir,
    write_report,
)


def chunk_plan(tokens: int, first_block: int, vocab: int) -> BatchPlan:
    """A fresh sequence's first `tokens` prompt tokens, in blocks from `first_block` on (none of the
    decode batch's)."""
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    blocks = tuple(range(first_block, first_block + math.ceil(tokens / BLOCK)))
    return BatchPlan((ScheduledChunk("prompt", tuple(ids), 0, blocks, True, GREEDY, ids, ()),))


def mixed_row(runner, batch: int, ctx: int, tokens: int, iters: int) -> dict:  # noqa: ANN001
    decode_blocks = batch * math.ceil(ctx / BLOCK)
    decode = decode_plan(batch, ctx, decode_blocks, seed=batch)
    chunk = chunk_plan(tokens, decode_blocks, runner.model_config.vocab_size)
    mixed = BatchPlan(decode.chunks + chunk.chunks)
    decode_ms = median_ms(lambda: runner.execute(decode), iters)
    chunk_ms = median_ms(lambda: runner.execute(chunk), iters)
    mixed_ms = median_ms(lambda: runner.execute(mixed), iters)
    row = {"batch": batch, "ctx": ctx, "chunk": tokens, "decode_ms": decode_ms, "chunk_ms": chunk_ms,
           "mixed_ms": mixed_ms, "share": (mixed_ms - chunk_ms) / decode_ms,
           "of_sum": mixed_ms / (chunk_ms + decode_ms)}
    print("row", json.dumps(row), flush=True)  # progress that survives a time limit
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", help="default 8 32 64 128; 2 4 with --smoke")
    parser.add_argument("--chunks", type=int, nargs="+", help="default 128 512 2048; 32 with --smoke")
    parser.add_argument("--ctx", type=int, help="default 1024; 64 with --smoke")
    parser.add_argument("--iters", type=int, help="default 20; 2 with --smoke")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    # --smoke checks the code paths on CPU in seconds: the full shapes there take minutes and say nothing
    args.batches = args.batches or ([2, 4] if args.smoke else [8, 32, 64, 128])
    args.chunks = args.chunks or ([32] if args.smoke else [128, 512, 2048])
    args.ctx = args.ctx or (64 if args.smoke else 1024)
    args.iters = args.iters or (2 if args.smoke else 20)
    from engine.loader import load_model
    from engine.model_runner import ModelRunner

    model_dir = write_model_dir(SMOKE if args.smoke else LLAMA31_8B)
    env, ceilings = environment(), measure_ceilings(not args.smoke)
    num_blocks = max(args.batches) * math.ceil(args.ctx / BLOCK) + math.ceil(max(args.chunks) / BLOCK) + 1
    config = bench_engine_config(model_dir, args.smoke, num_blocks, max_num_seqs=max(args.batches) + 1)
    loaded = load_model(model_dir, "dummy", config.dtype, config.device)
    runner = ModelRunner(config, loaded.model_config, loaded.weights)
    runner.randomize_kv_cache(seed=1)
    rows = [mixed_row(runner, b, args.ctx, t, args.iters) for b in args.batches for t in args.chunks]
    write_report(args.out, env, ceilings, rows,
                 ["batch", "ctx", "chunk", "decode_ms", "chunk_ms", "mixed_ms", "share", "of_sum"])


if __name__ == "__main__":
    main()
