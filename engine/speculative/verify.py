"""Verifying a draft: which of its tokens the target model keeps, and the token that follows them.

A chunk with draft d_1..d_k is sampled at k+1 positions: row j (0..k) is the target model's next-token
distribution p_j after the known tokens and d_1..d_j. Walking the rows in order, d_{j+1} is accepted
when row j's sample equals it; the first row whose sample differs gives the correction, and after a
fully accepted draft row k gives a bonus token. So a step yields between 1 and k+1 tokens.

Why this is exact (Leviathan et al. 2023, with a point-mass draft q = delta(d)): speculative sampling
accepts d with probability min(1, p(d)/q(d)) = p(d) and otherwise samples the residual
norm(max(0, p - q)), which is p with d removed and renormalised. Drawing t ~ p and accepting iff
t == d does exactly that: P(accept) = p(d), and a rejected draw is t ~ p conditioned on t != d, the
residual. Greedy rows are the special case p = one-hot(argmax). Every row is sampled with the
request's own sampling settings, penalties over the outputs as they would be at that position, and
(for seeded requests) the noise of that output position, so a seeded request draws the same tokens
with or without speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.batch import SampledToken, ScheduledChunk, StepResult


def verification_rows(chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
    """The sampler's rows for sampling `chunks`, in order: one per chunk without a draft, k+1 for a chunk
    with a draft of k. Row j of a draft carries output tokens extended by d_1..d_j, so penalties and
    per-request seeds see the position that row samples."""
    rows: list[ScheduledChunk] = []
    for c in chunks:
        if not c.num_draft_tokens:
            rows.append(c)
            continue
        draft = c.draft_token_ids
        known = c.token_ids[:1]
        rows.append(dataclasses.replace(c, token_ids=known, num_draft_tokens=0))
        for j in range(1, len(draft) + 1):
            rows.append(dataclasses.replace(c, token_ids=known, num_draft_tokens=0,
                                            output_token_ids=[*c.output_token_ids, *draft[:j]]))
    return rows


def accept_drafts(chunks: Sequence[ScheduledChunk], tokens: Sequence[SampledToken]) -> StepResult:
    """Fold the sampled rows (from `verification_rows(chunks)`) back into one result per chunk."""
    if len(tokens) != sum(c.num_draft_tokens + 1 for c in chunks):
        raise ValueError(f"{len(tokens)} sampled rows for chunks needing "
                         f"{sum(c.num_draft_tokens + 1 for c in chunks)}")
    sampled: dict[str, SampledToken] = {}
    accepted: dict[str, tuple[SampledToken, ...]] = {}
    row = 0
    for c in chunks:
        draft = c.draft_token_ids
        n = 0
        while n < len(draft) and tokens[row + n].token_id == draft[n]:
            n += 1
        if draft:
            accepted[c.request_id] = tuple(tokens[row:row + n])
        sampled[c.request_id] = tokens[row + n]
        row += len(draft) + 1
    return StepResult(sampled=sampled, accepted=accepted)
