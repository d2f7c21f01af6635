"""Where FP8's error comes from, per projection and per layer's K/V, for the scale choices one could make.

    python -m lab.micro.fp8_error_breakdown --out fp8_err.json            # one 256-token ShareGPT answer
    python -m lab.micro.fp8_error_breakdown --tokens 32 --out /tmp/e.json  # seconds (CI smoke)

One unquantized teacher-forced pass of the default model (float32, CPU). For every dense projection, its
input x and weight W are rounded to e4m3 under each choice and ||xW^T - x'W'^T|| / ||xW^T|| reported:
activations per token or per token and 128-column group, weights per output channel or per 128 x 128
block, and both (per token x per channel, what a prefill runs). For every layer's K and V as the cache
holds them: ||x - fp8(x)|| / ||x|| with scale 1.0 (the default), the layer's absmax / 448 and a per-head
absmax / 448. If scale choices mattered, they would show here; lab/micro/fp8_accuracy.py measures what the
rounding costs in tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from engine.layers.linear import Linear
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.quant import fp8
from lab.micro.fp8_passes import make_engine, sequence_logits
from loadtest.sharegpt import iter_records, open_sharegpt

PROJECTION_CHOICES = ("act_per_token", "act_per_group128", "weight_per_channel", "weight_block128", "prefill")
KV_CHOICES = ("scale_1", "layer_absmax", "head_absmax")


def _rel(exact: torch.Tensor, approx: torch.Tensor) -> float:
    return float((exact - approx).norm() / exact.norm())


def projection_errors(x: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    x_tok = fp8.dequantize_rows(*fp8.quantize_rows(x))
    x_grp = fp8.dequantize_blocks_rows(*fp8.quantize_row_groups(x))
    w_row = fp8.dequantize_rows(*fp8.quantize_rows(w))
    w_blk = fp8.dequantize_blocks(*fp8.quantize_blocks(w))
    y = x @ w.t()
    return {"act_per_token": _rel(y, x_tok @ w.t()), "act_per_group128": _rel(y, x_grp @ w.t()),
            "weight_per_channel": _rel(y, x @ w_row.t()), "weight_block128": _rel(y, x @ w_blk.t()),
            "prefill": _rel(y, x_tok @ w_row.t())}


def kv_errors(x: torch.Tensor) -> dict[str, float]:  # x [tokens, heads, head_dim]
    def round_trip(scale: torch.Tensor) -> torch.Tensor:
        return fp8.to_fp8(x, scale).float() * scale

    head = x.abs().amax(dim=(0, 2), keepdim=True) / fp8.FP8_MAX
    return {"scale_1": _rel(x, round_trip(torch.tensor(1.0))),
            "layer_absmax": _rel(x, round_trip(x.abs().max() / fp8.FP8_MAX)),
            "head_absmax": _rel(x, round_trip(head))}


def answer_tokens(engine: LLMEngine, tokens: int) -> list[int]:
    assert engine.tokenizer is not None
    with open_sharegpt() as stream:
        for record in iter_records(stream, max_records=2000):
            for turn in record.get("conversations") or []:
                ids = engine.tokenizer.encode(turn.get("value", ""), add_special_tokens=False)
                if turn.get("from") == "gpt" and len(ids) >= tokens:
                    return ids[:tokens]
    raise SystemExit(f"no ShareGPT answer of {tokens} tokens")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    engine = make_engine("float32", None, "auto", 1)
    ids = answer_tokens(engine, args.tokens)
    projections: dict[str, dict[str, float]] = {}

    def record(name: str) -> Callable[[Linear, tuple[torch.Tensor, ...], torch.Tensor], None]:
        def hook(module: Linear, inputs: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            projections[name] = projection_errors(x, module.weight.float())
        return hook

    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # one process: the default model needs no tensor parallelism
    for name, module in runner.model.named_modules():
        if isinstance(module, Linear):
            module.register_forward_hook(record(name))
    sequence_logits(engine, ids)
    spec = runner.kv_spec
    cache = runner.kv_cache[: -(-len(ids) // spec.block_size)].float()  # [blocks, L, 2, bs, H, D]
    kv = {f"layer{layer}.{which}": kv_errors(cache[:, layer, i].reshape(-1, *cache.shape[-2:])[: len(ids)])
          for layer in range(cache.shape[1]) for i, which in enumerate("kv")}
    summary = {c: statistics.mean(p[c] for p in projections.values()) for c in PROJECTION_CHOICES}
    summary |= {f"kv_{c}": statistics.mean(e[c] for e in kv.values()) for c in KV_CHOICES}
    for key, value in summary.items():
        print(f"{key:22s} mean relative error {value:.4f}")
    with open(args.out, "w") as f:
        json.dump({"tokens": len(ids), "summary": summary, "projections": projections, "kv": kv}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
