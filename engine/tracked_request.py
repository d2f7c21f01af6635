"""`TrackedRequest`: the engine's state of a request beside the batcher's Sequence, and its stop rules."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import FinishReason
from engine.sequence import Sequence
from tokenization.detokenizer import IncrementalDetokenizer


@dataclass
class TrackedRequest:
    """Engine-side state of a request (built by engine/request_intake.py)."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    stop_ids: frozenset[int]
    hold_for_s: float | None = None  # stop after the first token and hold the blocks this long
    checksum_hold: bool = False  # checksum the held blocks in the step that finishes the prefill
    checksum_slices: int = 1  # ... per head slice, for a decode worker of this TP size (heterogeneous TP)
    started_at: float | None = None  # engine clock at its first scheduled chunk (queue wait ends)

    def finish_reason(self, token: int, num_output: int, max_num_tokens: int) -> FinishReason | None:
        """Whether the request finishes at `token`, its `num_output`-th output token; `max_num_tokens`:
        the batcher's length limit (the context window, or the KV pool when that is smaller)."""
        if token in self.stop_ids:
            return FinishReason.STOP
        if self.detok is not None and self.detok.stopped:
            return FinishReason.STOP
        if num_output >= self.seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if self.seq.num_prompt_tokens + num_output >= max_num_tokens:
            return FinishReason.LENGTH
        return None
