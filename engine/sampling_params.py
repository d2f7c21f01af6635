"""Per-request sampling parameters, validated at creation (bad values never reach the engine loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.structured.constraint import GuidedDecoding

MAX_LOGPROBS = 20
MAX_DRAFT_TOKENS = 16  # longest speculative draft one request may ask for per step


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch
    presence_penalty: float = 0.0  # OpenAI semantics, applied to generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/CTRL semantics, applied to prompt and generated tokens
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the match
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: the sampled token's logprob plus top-n
    guided: GuidedDecoding | None = None  # grammar constraint (structured outputs, tool calls); holds its state
    # Speculative decoding (engine/speculative): up to this many n-gram draft tokens verified per step.
    # None: the engine's default (`SpeculativeConfig.num_draft_tokens`, `--speculative-ngram`); 0: off.
    num_draft_tokens: int | None = None
    # A migrated generation (services/gateway/completions/migration.py): the prompt's last N tokens are output this
    # request generated on another worker. Seeded noise continues at their position and presence /
    # frequency penalties count them as output, so the continuation samples as one run would have.
    prior_output_tokens: int = 0
    # Admission order among the requests waiting on this worker: lower first, first come first served
    # within one priority (vLLM's convention). The worker sets it from the request's tier.
    priority: int = 0

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0,
               f"temperature must be a finite number >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ids >= 0")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.num_draft_tokens is None or 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS,
               f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        _check(self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        _check(self.prior_output_tokens >= 0, f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        _check(self.priority >= 0, f"priority must be >= 0, got {self.priority}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
