"""n > 1 under disaggregation, the runner's part: sibling choices' first tokens from one prompt's logits.

A held prefill of an n-choice request carries the siblings' sampling settings (`ScheduledChunk.
choice_samplings`). The runner samples the chunk's last row once more per sibling, each row under that
choice's own settings (seed, temperature, logprobs): the same logits and the same output position as
the choice would have sampled alone, so its first token and logprobs match the co-located path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.batch import SampledToken, ScheduledChunk
from engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ChoiceRows:
    """The extra sampler rows of a step: which logits row each repeats, and as which choice."""

    source_rows: tuple[int, ...]  # index into the step's sampled logits rows
    rows: tuple[ScheduledChunk, ...]  # the chunk as each sibling choice (its sampling)

    def split(self, chunks: Sequence[ScheduledChunk],
              tokens: Sequence[SampledToken]) -> dict[str, tuple[SampledToken, ...]]:
        """The siblings' tokens (the sampler's output for `rows`), per request in choice order."""
        out: dict[str, tuple[SampledToken, ...]] = {}
        i = 0
        for c in chunks:
            if c.choice_samplings:
                out[c.request_id] = tuple(tokens[i:i + len(c.choice_samplings)])
                i += len(c.choice_samplings)
        return out


def choice_rows(chunks: Sequence[ScheduledChunk]) -> ChoiceRows:
    """Extra rows for the sampling `chunks` that carry sibling choices (none: both tuples empty)."""
    sources: list[int] = []
    rows: list[ScheduledChunk] = []
    row = 0
    for c in chunks:
        row += c.num_sampled_rows
        for sampling in c.choice_samplings:
            if c.num_draft_tokens:
                raise ValueError(f"{c.request_id!r}: a chunk with sibling choices cannot carry a draft")
            sources.append(row - 1)
            rows.append(dataclasses.replace(c, sampling=sampling, choice_samplings=()))
    return ChoiceRows(tuple(sources), tuple(rows))


@dataclasses.dataclass(frozen=True)
class ChoiceFork:
    """A sibling choice to fork from a committed remote prefill (`LLMEngine.commit_remote`)."""

    request_id: str
    params: SamplingParams
    first: SampledToken  # its first token, sampled by the prefill worker under `params`
