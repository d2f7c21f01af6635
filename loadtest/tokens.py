"""Token counting for the harness: the engine's real tokenizer, or an approximation by words.

Prompt lengths (random dataset, ShareGPT filters) and, when a server does not report `usage`, output
lengths are counted here. Every result states which counter was used (`PromptTokenizer.kind`), because
"1024-token prompts" means little unless one knows whose tokens.

- `engine`: `tokenization.tokenizer.Tokenizer` of the default model (SmolLM2-135M-Instruct) or of a given
  Hugging Face directory (`--tokenizer PATH`). Exact for that model.
- `words`: whitespace-separated words, one token each. An approximation (English BPE averages about
  1.3 tokens per word), used when the engine or its model files are not available, or on request.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path

_WORDS = """
time year people way day man thing woman life child world school state family student group country problem
hand part place case week company system program question work government number night point home water room
mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history party result
change morning reason research girl guy moment air teacher force education
"""
WORD_LIST = tuple(_WORDS.split())
MAX_WORDS = 4096


class PromptTokenizer(ABC):
    """Counts tokens and builds text of an exact token count. Implementations are immutable."""

    kind: str  # "engine" or "words": written into every result

    @abstractmethod
    def count(self, text: str) -> int:
        """Number of tokens in `text` (no special tokens added)."""

    @abstractmethod
    def random_text(self, num_tokens: int, rng_ints: list[int]) -> str:
        """Text that `count` measures as exactly `num_tokens`; `rng_ints` are random non-negative ints,
        one per token, so that the caller's seeded generator alone decides the content."""


class WordTokenizer(PromptTokenizer):
    """One token per whitespace-separated word: an approximation, stated as `kind == "words"`."""

    kind = "words"

    def count(self, text: str) -> int:
        return len(text.split())

    def random_text(self, num_tokens: int, rng_ints: list[int]) -> str:
        return " ".join(WORD_LIST[i % len(WORD_LIST)] for i in rng_ints[:num_tokens])


class EngineTokenizer(PromptTokenizer):
    """The serving engine's tokenizer. Random text is drawn from single-token words (" apple") so that
    decode -> encode is the identity and the count is exact by construction (checked anyway)."""

    kind = "engine"

    def __init__(self, tokenizer, name: str) -> None:  # noqa: ANN001 - tokenization.tokenizer.Tokenizer
        self._tok = tokenizer
        self.name = name

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def random_text(self, num_tokens: int, rng_ints: list[int]) -> str:
        ids = [self._word_ids[i % len(self._word_ids)] for i in rng_ints[:num_tokens]]
        text = self._tok.decode(ids)
        assert self.count(text) == num_tokens, "single-token words must re-encode one to one"
        return text

    @cached_property
    def _word_ids(self) -> list[int]:
        """Ids of vocabulary entries that are a space + lowercase letters and encode back to themselves
        (the first MAX_WORDS of them in id order: plenty of variety, and a bounded start-up cost)."""
        ids: list[int] = []
        for tid in range(self._tok.vocab_size):
            text = self._tok.decode([tid])
            if re.fullmatch(r" [a-z]{3,12}", text) and self._tok.encode(text, add_special_tokens=False) == [tid]:
                ids.append(tid)
                if len(ids) == MAX_WORDS:
                    break
        if len(ids) < 100:
            raise ValueError(f"tokenizer {self.name} has too few single-token words ({len(ids)})")
        return ids


def load_tokenizer(spec: str = "default", cache_dir: str | Path | None = None) -> PromptTokenizer:
    """`spec`: "default" (the engine's default model, falling back to words if it can't be loaded),
    "words", or a path to a Hugging Face directory with tokenizer.json (errors if it can't be loaded)."""
    if spec == "words":
        return WordTokenizer()
    try:
        from tokenization.tokenizer import Tokenizer
    except ImportError:
        if spec == "default":
            return WordTokenizer()
        raise
    if spec != "default":
        return EngineTokenizer(Tokenizer.from_dir(spec), name=str(spec))
    try:
        from engine.loader import default_model_dir

        path = default_model_dir(cache_dir)
        return EngineTokenizer(Tokenizer.from_dir(path), name=path.name)
    except Exception:  # no model package / conversion failed: fall back, and the result says "words"
        return WordTokenizer()
