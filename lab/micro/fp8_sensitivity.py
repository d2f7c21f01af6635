"""Which projections carry FP8's accuracy loss: quantize one kind of projection, or one group of layers,
at a time, and measure the teacher-forced top-1 agreement and KL divergence against bf16.

    python -m lab.micro.fp8_sensitivity --out sens.json                     # 32 prompts x 96 tokens
    python -m lab.micro.fp8_sensitivity --prompts 2 --new-tokens 8 --only all keep:down --out /tmp/s.json

The default model runs in bf16 (GEMMs through float32: fp8_passes.emulated_bf16_gemm), unquantized; a
variant replaces the chosen rows of the chosen projections by the arithmetic of the engine's FP8 reference
(engine/quant/fp8.py): the weight quantized per output row to e4m3, multiplied in float32 with
the activations rounded per token as a prefill rounds them, the output in bf16. Rows, not modules, because
q/k/v and gate/up are merged into one matmul; with per-row scales, quantizing q's rows of it is quantizing
q_proj alone. `all` is what `--quantization fp8` serves; tests/unit/lab/test_fp8_sensitivity.py checks
that it gives the engine's own FP8 logits.

Two kinds of variant: `only:<part>` quantizes just that part (the loss it causes alone), `keep:<part>`
quantizes everything else (what keeping it in bf16 buys), where a part is a projection kind (q, k, v, o,
gate, up, down), a layer range (`layers0-4`), or both (`down@layers0-1`). Each reports the share of the
projections' parameters it leaves in bf16 (the memory cost of keeping them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from engine.layers.linear import ColumnParallelLinear, Linear
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaDecoderLayer
from engine.quant import fp8
from lab.micro.fp8_passes import Corpus, build_corpus, continuation_logits, emulated_bf16_gemm, make_engine

KINDS = ("q", "k", "v", "o", "gate", "up", "down")
_MODULE_OF_KIND = {"q": ("self_attn.qkv_proj", 0), "k": ("self_attn.qkv_proj", 1),
                   "v": ("self_attn.qkv_proj", 2), "o": ("self_attn.o_proj", 0),
                   "gate": ("mlp.gate_up_proj", 0), "up": ("mlp.gate_up_proj", 1), "down": ("mlp.down_proj", 0)}


@dataclasses.dataclass(frozen=True)
class Part:
    """Projection kinds in a range of layers (both inclusive)."""

    kinds: tuple[str, ...]
    first_layer: int
    last_layer: int

    def holds(self, kind: str, layer: int) -> bool:
        return kind in self.kinds and self.first_layer <= layer <= self.last_layer


def parse_part(spec: str, num_layers: int) -> Part:
    """`down`, `q+k`, `layers0-4`, `down@layers0-1` -> Part."""
    kinds: tuple[str, ...] = KINDS
    first, last = 0, num_layers - 1
    for piece in spec.split("@"):
        if piece.startswith("layers"):
            lo, _, hi = piece.removeprefix("layers").partition("-")
            first, last = int(lo), int(hi or lo)
        else:
            kinds = tuple(piece.split("+"))
            if not set(kinds) <= set(KINDS):
                raise ValueError(f"part {spec!r}: projection kinds are {', '.join(KINDS)}")
    return Part(kinds, first, last)


@dataclasses.dataclass(frozen=True)
class Variant:
    """Quantize the parts (`quantize_parts`) or everything but them."""

    quantize_parts: bool
    parts: tuple[Part, ...]

    @classmethod
    def parse(cls, name: str, num_layers: int) -> Variant:
        """`all`, `only:<part>[,<part>...]` or `keep:<part>[,<part>...]`."""
        if name == "all":
            return cls(False, ())
        mode, _, spec = name.partition(":")
        if mode not in ("only", "keep") or not spec:
            raise ValueError(f"variant {name!r}: expected all, only:<parts> or keep:<parts>")
        return cls(mode == "only", tuple(parse_part(piece, num_layers) for piece in spec.split(",")))

    def quantizes(self, kind: str, layer: int) -> bool:
        return any(part.holds(kind, layer) for part in self.parts) == self.quantize_parts


def default_variants(num_layers: int) -> list[str]:
    last = num_layers - 1
    blocks = [f"only:layers{i}-{min(i + 4, last)}" for i in range(0, num_layers, 5)]
    return ["all", *(f"only:{k}" for k in KINDS), *blocks, "only:layers0", f"only:layers{last}",
            "keep:down", f"keep:layers0,layers{last}", f"keep:layers0-1,layers{last - 1}-{last}"]


def fake_fp8_matmul(linear: Linear, rows: list[tuple[int, int]]
                    ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """`linear.matmul` with output rows `rows` ((start, count) each) computed as the FP8 reference
    computes them, the other rows as they were. The engine quantizes the checkpoint's weight after the
    loader cast it to the model's dtype, so this quantizes the bf16 weight too (quantizing the float32
    checkpoint instead picks other row scales, a different but equally good rounding)."""
    index = torch.cat([torch.arange(start, start + count) for start, count in rows])
    weight = linear.weight
    w_real = fp8.dequantize_rows(*fp8.quantize_rows(weight.detach()[index]))

    def matmul(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= fp8.WEIGHT_ONLY_MAX_ROWS:
            quantized = x2.float() @ w_real.t()
        else:
            quantized = fp8.reference_linear(x2, w_real, blocked=False)
        out.view(-1, out.shape[-1])[:, index] = quantized.to(out.dtype)
        return out

    return matmul


def projections(runner: ModelRunner) -> Iterator[tuple[int, str, Linear, tuple[int, int]]]:
    """(layer, kind, linear, its (start, count) rows) of every dense projection."""
    for layer, decoder in enumerate(runner.model.model.layers):
        assert isinstance(decoder, LlamaDecoderLayer)
        for kind, (path, shard) in _MODULE_OF_KIND.items():
            linear = decoder.get_submodule(path)
            assert isinstance(linear, Linear)
            if isinstance(linear, ColumnParallelLinear):
                rows = (linear.offsets[shard], linear.output_sizes[shard])
            else:
                rows = (0, linear.weight.shape[0])
            yield layer, kind, linear, rows


def apply_variant(runner: ModelRunner, variant: Variant) -> float:
    """Install the variant's FP8 rows; the share of projection parameters left in bf16."""
    chosen: dict[int, list[tuple[int, int]]] = {}
    kept = total = 0
    for layer, kind, linear, rows in projections(runner):
        size = rows[1] * linear.weight.shape[1]
        total += size
        if variant.quantizes(kind, layer):
            chosen.setdefault(id(linear), []).append(rows)
        else:
            kept += size
    for _, _, linear, _ in projections(runner):
        linear.__dict__.pop("matmul", None)
        if id(linear) in chosen:
            linear.matmul = fake_fp8_matmul(linear, chosen[id(linear)])  # type: ignore[method-assign, assignment]
    return kept / total


@torch.inference_mode()
def measure(engine: LLMEngine, corpus: Corpus, base_logp: list[torch.Tensor]) -> dict[str, float]:
    hits = total = 0
    kl = 0.0
    for prompt, cont, ref, logp in zip(corpus.prompts, corpus.continuations, corpus.references, base_logp,
                                       strict=True):
        logits = continuation_logits(engine, prompt, cont)
        hits += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        kl += float((logp.exp() * (logp - torch.log_softmax(logits, -1))).sum())
        total += len(cont)
    return {"top1_agreement": hits / total, "kl": kl / total, "positions": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--only", nargs="+", help="variants to run (default: a sweep, see default_variants)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    start = time.perf_counter()
    with emulated_bf16_gemm():
        engine = make_engine("bfloat16", None, "auto", args.prompts)
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        num_layers = len(runner.model.model.layers)
        variants = args.only or default_variants(num_layers)
        parsed = {name: Variant.parse(name, num_layers) for name in variants}  # bad names fail before the work
        corpus = build_corpus(engine, args.prompts, args.new_tokens, 0, 0)
        base_logp = [torch.log_softmax(continuation_logits(engine, p_, c), -1)
                     for p_, c in zip(corpus.prompts, corpus.continuations, strict=True)]
        report: dict = {"prompts": args.prompts, "new_tokens": args.new_tokens, "variants": {}}
        for name, variant in parsed.items():
            share = apply_variant(runner, variant)
            result = measure(engine, corpus, base_logp) | {"bf16_share": share}
            report["variants"][name] = result
            print(f"[{time.perf_counter() - start:6.0f} s] {name:24s} top-1 {result['top1_agreement']:7.2%}  "
                  f"KL {result['kl']:.4f}  bf16 share {share:6.1%}", flush=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
