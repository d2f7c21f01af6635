"""Taking a generation over from a worker that died: retry before the first token, migrate after it.

A choice whose worker is lost (`WorkerLostError`: the worker is gone, refused the call, or broke the
stream) is placed again through the normal routing, with the dead worker reported and avoided:

- no token received yet: a *retry*, the same request on another worker; the client sees nothing;
- tokens received: a *migration* (Dynamo's request migration): the prompt plus the tokens so far is
  the new prompt, `max_tokens` shrinks by what was generated, the sampling parameters stay, and a
  seeded request continues its noise where it stopped (`prior_output_tokens`). The stream goes on
  under the same response id and event ids; greedy output is unchanged.

Text across the seam: the new worker's detokenizer knows nothing of the text already sent, so a stop
string that began before the seam, a character split over the seam or text the old worker still held
back would come out wrong. After a migration the gateway therefore re-derives the text itself with the
engine's own `IncrementalDetokenizer`, replayed over the tokens received so far (`Continuation`): the
text, the stop-string cut and the finish reason are exactly what one uninterrupted worker would have
produced.

Each choice may be re-placed at most `max_migrations` times (retries and migrations together);
`baton_request_migrations_total{outcome}` counts every decision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from services.gateway.completions.generation import GenerationDelta, SamplingSpec
from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.finish_reason import FinishReason
from tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DEFAULT_MAX_MIGRATIONS = 3


class MigrationOutcome(StrEnum):
    RETRIED = "retried"  # lost before the first token: the same request placed elsewhere
    MIGRATED = "migrated"  # lost mid-stream: prompt + tokens so far continued elsewhere
    LIMIT_EXCEEDED = "limit_exceeded"  # the choice was already re-placed max_migrations times
    NO_WORKER = "no_worker"  # routing found no other worker: the choice fails (clean SSE error)


@dataclass(frozen=True)
class MigrationPolicy:
    tokenizer: Tokenizer
    max_migrations: int = DEFAULT_MAX_MIGRATIONS

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")


@dataclass(frozen=True)
class Attempt:
    """What one worker call of a choice runs: the first, a retry, or a migration."""

    number: int  # 0 for the first placement
    request_id: str  # unique per attempt: the worker and the scheduler see each attempt apart
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    continuation: Continuation | None = None  # set for migrations: the gateway re-derives the text

    @property
    def migrated(self) -> bool:
        return self.continuation is not None


def first_attempt(request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec) -> Attempt:
    return Attempt(0, request_id, prompt_token_ids, sampling)


def next_attempt(previous: Attempt, base_request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                 generated: Sequence[int], tokenizer: Tokenizer) -> Attempt:
    """The attempt after `previous` was lost, `generated` tokens into the choice (prompt and sampling as
    first asked, `max_tokens` already capped by the scheduler)."""
    number = previous.number + 1
    request_id = f"{base_request_id}~m{number}"
    if not generated:
        return Attempt(number, request_id, prompt_token_ids, sampling)
    continued = replace(sampling, max_tokens=sampling.max_tokens - len(generated),
                        prior_output_tokens=sampling.prior_output_tokens + len(generated))
    continuation = Continuation(tokenizer, prompt_token_ids, sampling.stop, generated)
    return Attempt(number, request_id, [*prompt_token_ids, *generated], continued, continuation)


class Continuation:
    """The text of a migrated choice, derived in the gateway as the first worker would have.

    Built from the original prompt and the tokens received before the seam (their text was already
    sent or is still held back, exactly as the old worker's detokenizer left it); `translate` turns each
    delta of the new worker into the delta that continues the same text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: tuple[str, ...],
                 generated: Sequence[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop)
        for token in generated:
            self._detok.add(token)

    def translate(self, delta: GenerationDelta) -> GenerationDelta:
        """The new worker's delta with the text re-derived, cut after a stop string that completes
        across the seam (the caller then ends the choice with `stop` and aborts the worker)."""
        text, kept = "", 0
        for token in delta.token_ids:
            text += self._detok.add(token)
            kept += 1
            if self._detok.stopped:
                break
        finish = delta.finish_reason
        if self._detok.stopped:
            finish = FinishReason.STOP
        elif finish is not None:
            text += self._detok.flush()
        # The prompt was billed with the first attempt: the re-prefilled prompt is not the client's.
        return replace(delta, token_ids=delta.token_ids[:kept], text=text, logprobs=delta.logprobs[:kept],
                       finish_reason=finish, num_prompt_tokens=0, num_cached_tokens=0)
