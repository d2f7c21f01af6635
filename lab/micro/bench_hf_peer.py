"""transformers `generate` against baton's engine, same card, same run: generated tokens/s at batch 1 and 32.

    python -m lab.micro.bench_hf_peer --out hf_peer.json
    python -m lab.micro.bench_hf_peer --model qwen3-30b-a3b --out hf_peer_moe.json   # the MoE peer
    python -m lab.micro.bench_hf_peer --smoke --out /tmp/h.json       # CPU: code paths only

Both sides: Llama-3.1-8B shape, or with `--model qwen3-30b-a3b` Qwen3-30B-A3B's (bench_moe.py;
transformers runs Qwen3MoeForCausalLM with its default experts implementation, recorded in the
report as `hf_experts_implementation`); `--layers N` cuts both sides to N decoder layers where the
whole model would not fit a time box. Dummy bf16 weights (each side its own random values: the speed
does not depend on them; random routers spread tokens near-evenly over the experts on both sides),
B prompts of 128 random tokens, 128 new tokens each, greedy, no early stop.
- transformers: one static batch, `generate(do_sample=False, max_new_tokens=128)` with no EOS id,
  SDPA attention, its default dynamic KV cache, no torch.compile.
- baton: `LLMEngine.generate` (continuous batching, paged KV, Triton attention, CUDA graphs), the B
  requests submitted at once with `ignore_eos`.
tokens/s = B * 128 / wall time of the whole call (prefill included), after one short warm-up call
with the same batch. ratio = baton / transformers. HF runs first and is freed before baton loads.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch

from engine.config import BatcherConfig, CacheConfig, EngineConfig
from lab.micro.bench_decode import (
    BLOCK,
    LLAMA31_8B,
    SMOKE,
    environment,
    measure_ceilings,
    write_model_dir,
    write_report,
)
from lab.micro.bench_moe import QWEN3_30B_A3B
from lab.micro.bench_moe import SMOKE as MOE_SMOKE

PROMPT_LEN = 128


MODELS = {"llama-3.1-8b": (LLAMA31_8B, SMOKE), "qwen3-30b-a3b": (QWEN3_30B_A3B, MOE_SMOKE)}
CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig"}


def hf_config(hf: dict):  # noqa: ANN201 - a transformers PretrainedConfig
    """Our config.json dict as a transformers 5 config of its architecture (rope settings under
    `rope_parameters`)."""
    import transformers

    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "rope_theta", "rope_scaling")}
    rope = dict(hf.get("rope_scaling") or {"rope_type": "default"}, rope_theta=hf["rope_theta"])
    config_cls = getattr(transformers, CONFIG_CLASSES[hf["architectures"][0]])
    return config_cls(**kwargs, rope_parameters=rope, eos_token_id=None, bos_token_id=None)


def prompts(batch: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))


def wall(fn, device: str) -> float:  # noqa: ANN001
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_hf(hf: dict, batches: list[int], new_tokens: int, device: str) -> tuple[dict[int, float], str | None]:
    """tokens/s per batch, and the experts implementation transformers chose (None: a dense model)."""
    import transformers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(hf), dtype=dtype, attn_implementation="sdpa")
    experts = getattr(model.config, "_experts_implementation", None) if "num_experts" in hf else None
    rates = {batch: _hf_rate(model.eval(), prompts(batch, hf["vocab_size"]).to(device), new_tokens, device)
             for batch in batches}
    del model  # 16-61 GB: gone before baton loads its own copy
    gc.collect()
    return rates, experts


@torch.inference_mode()
def _hf_rate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, device: str) -> float:
    run = lambda n: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,  # noqa: E731
                                   do_sample=False, pad_token_id=0)
    assert run(8).shape[1] == PROMPT_LEN + 8  # warm-up; and no early stop
    return ids.shape[0] * new_tokens / wall(lambda: run(new_tokens), device)


def bench_baton(model_dir: str, hf: dict, batches: list[int], new_tokens: int, smoke: bool) -> dict[int, float]:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    blocks = max(batches) * -(-(PROMPT_LEN + new_tokens) // BLOCK) * 2
    engine = LLMEngine(EngineConfig(
        model=model_dir, load_format="dummy", dtype="float32" if smoke else "bfloat16",
        device="cpu" if smoke else "cuda", attention_backend="torch" if smoke else "triton",
        cache=CacheConfig(block_size=BLOCK, num_blocks=blocks),
        batcher=BatcherConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * PROMPT_LEN)))
    result = {}
    for batch in batches:
        ids = prompts(batch, hf["vocab_size"]).tolist()
        run = lambda n, ids=ids: engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0,  # noqa: E731
                                                                     ignore_eos=True))
        assert all(len(o) == 8 for o in run(8))  # warm-up; and no early stop
        result[batch] = batch * new_tokens / wall(lambda run=run: run(new_tokens), "cpu" if smoke else "cuda")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--model", choices=MODELS, default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, help="cut both sides to this many decoder layers")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code, not the speed")
    args = parser.parse_args()
    full, smoke = MODELS[args.model]
    hf = dict(smoke if args.smoke else full)
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    device = "cpu" if args.smoke else "cuda"
    env, ceilings = environment(), measure_ceilings(not args.smoke)
    env.update(model=args.model, layers=hf["num_hidden_layers"])
    errors = {}
    try:
        hf_rates, env["hf_experts_implementation"] = bench_hf(hf, args.batches, args.new_tokens, device)
    except Exception:  # keep the other side's numbers; the error goes into the report
        errors["transformers"], hf_rates = traceback.format_exc(), {}
    if device == "cuda":
        torch.cuda.empty_cache()
    try:
        baton_rates = bench_baton(write_model_dir(hf), hf, args.batches, args.new_tokens, args.smoke)
    except Exception:
        errors["baton"], baton_rates = traceback.format_exc(), {}
    rows = [{"batch": b, "new_tokens": args.new_tokens, "hf_tok_s": hf_rates.get(b), "baton_tok_s": baton_rates.get(b),
             "ratio": baton_rates[b] / hf_rates[b] if b in hf_rates and b in baton_rates else None}
            for b in args.batches]
    for side, text in errors.items():
        print(f"--- {side} failed ---\n{text}")
        rows.append({"batch": "error", "side": side, "error": text.strip().splitlines()[-1]})
    write_report(args.out, env, ceilings, rows, ["batch", "new_tokens", "hf_tok_s", "baton_tok_s", "ratio"])


if __name__ == "__main__":
    main()
