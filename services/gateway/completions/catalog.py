"""`ModelCatalog`: the models this gateway serves, each with its own prompt builder and token texts.

A request names its model; the catalog answers that model's `ModelRuntime` or a 404
`model_not_found` listing the served ones. The scheduler routes by the same name to workers that
registered with it, so one gateway fronts several fleets.

Degraded mode may answer a request with its model's smaller fallback (the scheduler's
`degrade_models`). The prompt was already rendered and tokenized for the asked model, so the
fallback is only usable when this gateway serves it too, with a byte-identical tokenizer, and every
choice fits its context window; `fallback` checks exactly that.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.gateway.completions.formatting import TokenTexts
from services.gateway.completions.prompt import PreparedPrompt, PromptBuilder
from services.gateway.config import ServedModel
from services.gateway.errors import ModelNotFoundError, OverloadedError

log = logging.getLogger(__name__)
FALLBACK_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class ModelRuntime:
    served: ServedModel
    prompts: PromptBuilder
    tokens: TokenTexts
    tokenizer_digest: str  # sha256 of tokenizer.json: equal digests tokenize alike

    @classmethod
    def of(cls, prompts: PromptBuilder) -> ModelRuntime:
        served = prompts.model
        digest = hashlib.sha256((served.path / "tokenizer.json").read_bytes()).hexdigest()
        return cls(served, prompts, TokenTexts(prompts.tokenizer), digest)

    @property
    def name(self) -> str:
        return self.served.name


class ModelCatalog:
    def __init__(self, runtimes: Sequence[ModelRuntime]) -> None:
        if not runtimes:
            raise ValueError("a gateway serves at least one model")
        self._by_name = {r.name: r for r in runtimes}
        if len(self._by_name) != len(runtimes):
            raise ValueError(f"served model names must be unique, got {[r.name for r in runtimes]}")
        self.default = runtimes[0]

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def runtimes(self) -> list[ModelRuntime]:
        return list(self._by_name.values())

    def get(self, name: str) -> ModelRuntime:
        runtime = self._by_name.get(name)
        if runtime is None:
            raise ModelNotFoundError(name, self.names)
        return runtime

    def fallback(self, asked: str, served: str, prompts: Iterable[PreparedPrompt]) -> ModelRuntime:
        """The runtime of `served`, the model the scheduler degraded an `asked` request to; a 503
        (logged: it is a configuration error) when this gateway cannot answer with it."""
        runtime, why = self._by_name.get(served), ""
        if runtime is None:
            why = "this gateway does not serve it (add it to BATON_EXTRA_MODELS)"
        elif runtime.tokenizer_digest != self.get(asked).tokenizer_digest:
            why = "its tokenizer differs, and the prompt was tokenized for the asked model"
        elif any(len(p.token_ids) + p.max_tokens > runtime.served.context_window for p in prompts):
            why = f"the request does not fit its context window of {runtime.served.context_window} tokens"
        if runtime is None or why:
            log.error("the scheduler degraded a %r request to %r, which cannot serve it: %s", asked, served, why)
            raise OverloadedError(f"no capacity for model {asked!r} now", FALLBACK_RETRY_AFTER_S)
        return runtime
