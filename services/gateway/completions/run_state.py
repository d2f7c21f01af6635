"""The plain data of one completion request as it runs: the plan, each choice's state, its events.

`GenerationPlan` is decided before any worker is called (prompt, sampling, choices, the rate-limit
lease); `ChoiceState` accumulates what one generation produced; `ChoiceEvent` is one step of it, as
the SSE formatter sees it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.common.errors import BatonError
from services.gateway.completions.generation import SamplingSpec, TokenLogprob
from services.gateway.completions.prompt import PreparedPrompt, TemplateMessage
from services.gateway.tenancy.auth import Principal
from services.gateway.tenancy.ratelimit import RateLimitLease
from tokenization.finish_reason import FinishReason


@dataclass(frozen=True)
class ChoiceSpec:
    index: int  # the choice's index in the response
    request_id: str  # unique per generation (n > 1: one per choice): the worker's and billing's id
    prompt: PreparedPrompt
    sampling: SamplingSpec


@dataclass(frozen=True)
class GenerationPlan:
    completion_id: str
    created: int  # unix seconds, as in the response
    model: str
    principal: Principal
    choices: tuple[ChoiceSpec, ...]
    lease: RateLimitLease
    started_at: float  # time.monotonic() at arrival: TTFT and E2E count from here
    conversation_id: uuid.UUID | None = None
    conversation_messages: tuple[TemplateMessage, ...] = ()  # appended to the conversation at the end


@dataclass(frozen=True)
class ChoiceEvent:
    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    refusal: str | None = None  # why the content policy refused or halted the choice (chat: delta.refusal)


@dataclass
class ChoiceState:
    """Mutable: written only by the choice's own task, read after it ended."""

    spec: ChoiceSpec
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker_answered: bool = False  # the worker accepted the prompt (prefill ran or is running)
    first_token_at: float | None = None
    finished_at: float | None = None
    error: BatonError | None = None
    refusal: str | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.spec.prompt.token_ids)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = time.monotonic()
