"""`ModelSpec`: one model `baton serve` serves — the name clients send and where its weights are.

`baton serve --model [NAME=]SOURCE` (repeatable; the first is the default model): SOURCE is a
Hugging Face directory or a built-in name, `SmolLM2-135M-Instruct` (the default model) or
`baton-tiny-random` (a tiny random-weight model with the default's tokenizer, engine/loader/tiny.py);
built-ins are prepared into the cache before any worker starts. NAME defaults to the directory's
name, which is also what the workers and the gateway call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.errors import ConfigError
from services.gateway.config import DEFAULT_MODEL_NAME, TINY_MODEL_NAME

BUILTIN_MODELS = (DEFAULT_MODEL_NAME, TINY_MODEL_NAME)


@dataclass(frozen=True)
class ModelSpec:
    source: str  # an HF directory, or a name in BUILTIN_MODELS
    name: str | None = None  # None: the source's directory name

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        name, sep, source = text.partition("=")
        if not sep:
            return cls(text.strip())
        if not name.strip() or not source.strip():
            raise ConfigError(f"--model {text!r}: expected [NAME=]SOURCE")
        return cls(source.strip(), name.strip())

    @property
    def served_name(self) -> str:
        return self.name or Path(self.source).name

    @property
    def builtin(self) -> bool:
        return self.source in BUILTIN_MODELS


def check_unique(specs: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    names = [s.served_name for s in specs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ConfigError(f"--model: two models are named {duplicated}; name them apart with NAME=SOURCE")
    return specs
