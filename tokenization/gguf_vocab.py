"""A Hugging Face `tokenizers` tokenizer rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of one: the vocabulary, merges,
token types, special ids, an `add_bos` flag and a pre-tokenizer *name* (`tokenizer.ggml.pre`). The
name stands for the split regexes llama.cpp hard-codes in `llama-vocab.cpp`; `PRE_TOKENIZERS`
below rebuilds the same splits with `tokenizers` components. An unknown name is an error rather
than a guess: a wrong split still round-trips text but yields token ids the model never saw.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM, Llama 3, Qwen, Mistral-Nemo) is
built here; SentencePiece-style (`"llama"`, Llama 2) vocabularies are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tokenization.errors import ModelLoadError


class GGUFMetadata(Protocol):
    """What is read of an open GGUF file: the engine's `GGUFFile` (the reader is the engine's to own)."""

    path: Path

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key`; `default` when absent."""

    def arch_get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped metadata, e.g. `arch_get("context_length")`."""


# llama.cpp token types (gguf.TokenType).
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp: {"\p{N}", <gpt2 regex>}; HF's SmolLM2/StarCoder tokenizer.json spells it this way.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), _gpt2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _digits_then_gpt2
    ),
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
        _split_then_bytes(_LLAMA3_SPLIT),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _split_then_bytes(_QWEN2_SPLIT)),
}


def build_tokenizer(gfile: GGUFMetadata) -> Tokenizer:
    """The byte-level BPE tokenizer the file describes, special tokens included."""
    kind = gfile.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level)")
    pre = gfile.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        supported = ", ".join(PRE_TOKENIZERS)
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {supported}")
    tokens: list[str] = gfile.get("tokenizer.ggml.tokens") or []
    merges = [tuple(m.split(" ")) for m in gfile.get("tokenizer.ggml.merges") or []]
    if not tokens or any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"GGUF file {gfile.path} has no vocabulary or malformed merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(gfile, tokens)
    types: list[int] = gfile.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=False)
        if k == CONTROL
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=False)
        if k == USER_DEFINED
    ])
    return tok


def tokenizer_config(gfile: GGUFMetadata) -> dict[str, Any]:
    """`tokenizer_config.json` for the file: special tokens, BOS/EOS flags and the chat template."""
    tokens: list[str] = gfile.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        idx = gfile.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # "use tokenizer.json as is" in transformers 4 and 5
        "add_bos_token": bool(gfile.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gfile.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gfile.arch_get("context_length", 2048)),
    }
    template = gfile.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def _post_processor(gfile: GGUFMetadata, tokens: list[str]) -> processors.PostProcessor:
    """Add BOS/EOS around single sequences exactly when the file's flags say llama.cpp would."""
    add_bos = bool(gfile.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(gfile.get("tokenizer.ggml.add_eos_token", False))
    bos_id, eos_id = gfile.get("tokenizer.ggml.bos_token_id"), gfile.get("tokenizer.ggml.eos_token_id")
    if not (add_bos and bos_id is not None) and not (add_eos and eos_id is not None):
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_id] if add_bos and bos_id is not None else None
    eos = tokens[eos_id] if add_eos and eos_id is not None else None

    def segment(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, seq, eos) if t]

    single, pair = " ".join(segment("$A", 0)), " ".join(segment("$A", 0) + segment("$B", 1))
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
