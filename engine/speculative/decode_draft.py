"""Sizing and placing a speculative draft for one decode of the batcher's step.

A decode of a sequence that asks for drafts (`sampling.num_draft_tokens`) becomes its pending token
plus a draft of up to k tokens, verified in one pass. The draft is capped so that even a fully accepted
one (k + 1 new tokens) stays within max_tokens and the batcher's `max_num_tokens`, and so that every
later decode of the pass still gets its one token of budget; its KV slots are allocated with the
decode's (a draft that would need a preemption is dropped instead). Only the accepted drafts count as
computed: the rejected positions' KV slots stay allocated, are never hashed into the prefix cache (a
block is hashed only once all its tokens are computed), and the next step's chunk starts at the first
of them, so it overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence
from engine.speculative.base import DraftProposer


@dataclass(frozen=True)
class DraftRoom:
    """What a decode's draft may use without starving the decodes after it in the same pass."""

    budget: int  # tokens of the step's budget
    blocks: int  # free KV blocks


def place_draft(seq: Sequence, room: DraftRoom, proposer: DraftProposer | None, block_manager: BlockManager,
                max_num_tokens: int) -> tuple[int, ...]:
    """A draft for seq's decode, its KV slots allocated within `room.blocks`; () for none. A draft never
    costs a preemption, not even of a later sequence that would then find no free block."""
    k = min(seq.sampling.num_draft_tokens or 0, room.budget,
            seq.sampling.max_tokens - seq.num_output_tokens - 1, max_num_tokens - seq.num_tokens - 1)
    if k <= 0 or proposer is None:
        return ()
    draft = proposer.propose(seq.request_id, seq.all_token_ids, k)[:k]
    if not draft:
        return ()
    if block_manager.blocks_for(seq.num_tokens + len(draft)) - len(seq.block_ids) > room.blocks:
        return ()
    block_manager.append_slots(seq.block_ids, seq.num_tokens + len(draft))
    return draft
