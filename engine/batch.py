"""The plain-data hand-off between the batcher (what to run) and the model runner (running it).

The batcher never touches tensors and the model runner never decides anything: one engine step is
`plan = batcher.schedule()`, `result = runner.execute(plan)`, `batcher.postprocess(plan, result)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's share of a step: a prefill chunk, a single decode token, or a decode token followed
    by a speculative draft to verify (`num_draft_tokens` > 0: every position of the chunk is sampled)."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens run this step (K/V computed and stored for each)
    start_pos: int  # position of token_ids[0]; equals the tokens already in the KV cache
    block_ids: tuple[int, ...]  # the sequence's block table, covering start_pos + len(token_ids) slots
    needs_sample: bool  # the chunk ends at the last known token: sample the next one
    sampling: SamplingParams
    # Live views (not copies) of the sequence's tokens, for penalties; valid during this step only.
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The last `num_draft_tokens` of token_ids are a draft, not known tokens: their KV is written this
    # step but counts as computed only as far as the draft is accepted (the rest is overwritten later).
    num_draft_tokens: int = 0
    # n > 1 under disaggregation: the sampled row is also sampled once under each of these (the sibling
    # choices' first tokens, from the same prompt logits); set on a held prefill's first sample only.
    choice_samplings: tuple[SamplingParams, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_sampled_rows(self) -> int:
        """Positions whose logits are sampled: the last one, plus one per draft token."""
        return self.num_draft_tokens + 1 if self.needs_sample else 0

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class BatchPlan:
    """Everything one engine step runs, in order; an empty plan means nothing is runnable."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()  # request ids preempted (blocks freed) while planning this step
    # Copy-on-write of blocks shared by forked choices: (source, destination) block ids whose KV the
    # runner copies before the forward pass, so a choice appends into a block of its own.
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability (under the model's raw distribution) and the top-n."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class StepResult:
    """The model runner's answer: one sampled token per chunk with `needs_sample`, keyed by request.

    For a chunk with a draft, `accepted` holds the accepted prefix of the draft (possibly empty) and
    `sampled` the token that follows it: the correction at the first rejection, or the bonus token
    after a fully accepted draft. So a verify step yields `len(accepted) + 1` tokens.
    """

    sampled: dict[str, SampledToken]
    accepted: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    # Per chunk with `choice_samplings`: one token per sibling choice, in that order.
    choices: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
