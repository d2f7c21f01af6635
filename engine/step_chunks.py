"""Turning a sequence into its share of a step (`ScheduledChunk`) and reading a step's verdict on a
chunk's speculative draft back: the plain-data side of the batcher's plan."""

from __future__ import annotations

from engine.batch import SampledToken, ScheduledChunk, StepResult
from engine.errors import EngineError
from engine.sequence import Sequence


def next_chunk(seq: Sequence, n: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
    """The next `n` uncomputed tokens of `seq` (then its draft, if any) as one chunk."""
    start = seq.num_computed_tokens
    ends_at_last_token = start + n == seq.num_tokens
    return ScheduledChunk(
        request_id=seq.request_id,
        token_ids=tuple(seq.all_token_ids[start:start + n]) + draft,
        start_pos=start,
        block_ids=tuple(seq.block_ids),
        needs_sample=ends_at_last_token,
        sampling=seq.sampling,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=seq.output_token_ids,
        num_draft_tokens=len(draft),
        # Sibling choices sample their first tokens from the prompt's last logits only.
        choice_samplings=seq.choice_samplings if ends_at_last_token and not seq.output_token_ids else (),
    )


def accepted_draft(chunk: ScheduledChunk, result: StepResult) -> tuple[SampledToken, ...]:
    """The accepted prefix of a chunk's draft; the runner must return a prefix of what was sent."""
    if not chunk.num_draft_tokens:
        return ()
    accepted = result.accepted.get(chunk.request_id, ())
    if tuple(t.token_id for t in accepted) != chunk.draft_token_ids[:len(accepted)]:
        raise EngineError(f"the model runner accepted tokens outside the draft of {chunk.request_id!r}")
    return accepted
