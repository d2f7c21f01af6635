"""What the tokens a step appended to one request become: read one by one through its detokenizer and
stop rules, cut after the first that finishes it, and handed out as a `RequestOutput` delta.

Speculative decoding may append several tokens in one step (accepted drafts, then the sampled one);
the batcher already holds them all, but the request's output ends at its first finishing token.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.batch import SampledToken
from engine.outputs import FinishReason, HeldBlocks, RequestOutput
from engine.sequence import Sequence
from engine.tracked_request import TrackedRequest


@dataclass(frozen=True)
class StepTokens:
    """One request's tokens of a step, as far as they count."""

    sampled: tuple[SampledToken, ...]  # up to and including the first that finishes the request
    text: str  # their text; a finished request's held-back tail flushed (but a held prefill's)
    finish_reason: FinishReason | None  # a held prefill always finishes (like max_tokens=1)


def read_step_tokens(tracked: TrackedRequest, sampled: list[SampledToken], max_num_tokens: int) -> StepTokens:
    """Detokenize and check `sampled` for stops in order; `max_num_tokens`: the batcher's length limit."""
    seq = tracked.seq
    text, reason = "", None
    for i, s in enumerate(sampled):
        if tracked.detok is not None:
            text += tracked.detok.add(s.token_id)
        reason = tracked.finish_reason(s.token_id, seq.num_output_tokens - (len(sampled) - 1 - i), max_num_tokens)
        if reason is not None:
            sampled = sampled[:i + 1]
            break
    if tracked.hold_for_s is not None:
        reason = reason or FinishReason.LENGTH
    elif reason is not None and tracked.detok is not None and not tracked.detok.stopped:
        text += tracked.detok.flush()
    return StepTokens(tuple(sampled), text, reason)


def request_output(seq: Sequence, tokens: StepTokens, held: HeldBlocks | None,
                   choice_first: tuple[SampledToken, ...]) -> RequestOutput:
    """The delta of `seq` for one step; `choice_first` (sibling choices' first tokens) only goes out
    with a held prefill's output."""
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=tuple(s.token_id for s in tokens.sampled),
        new_text=tokens.text,
        logprobs=tuple(s.logprobs for s in tokens.sampled if s.logprobs is not None),
        finish_reason=tokens.finish_reason,
        num_prompt_tokens=len(seq.prompt_token_ids),
        num_cached_tokens=seq.num_cached_tokens,
        num_tier_loaded_tokens=seq.num_tier_loaded_tokens,
        held=held,
        choice_first=choice_first if held is not None else (),
    )
