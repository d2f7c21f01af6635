"""One request's mutable, engine-internal state: its tokens, its block table, where it is in the batcher.

Only the batcher changes `status`, `block_ids` and `num_computed_tokens`; the engine reads them and
decides when a sequence finishes. Never crosses a process boundary (RequestOutput does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.batch import TokenLogprobs
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, never admitted; holds no blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # holds blocks a remote prefill is writing; not scheduled
    LOADING_KV = "loading_kv"  # holds blocks a lower KV tier (host, disk) is copying into; not scheduled
    RUNNING = "running"  # admitted: holds blocks for all its tokens; prefilling (in chunks) or decoding
    PREEMPTED = "preempted"  # blocks taken back under memory pressure; queued to recompute all its tokens
    FINISHED = "finished"  # finished or aborted; holds no blocks and is no longer in the batcher


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. Identity matters (eq=False): two sequences are never "equal".

    Invariants while the batcher holds it:
    - `0 <= num_computed_tokens <= num_tokens`; the KV of tokens [0, num_computed_tokens) is in `block_ids`;
    - RUNNING: `block_ids` holds at least `num_tokens` slots; WAITING / PREEMPTED / FINISHED: no blocks;
    - a preempted sequence keeps its output tokens and recomputes prompt + outputs when resumed.
    """

    request_id: str
    prompt_token_ids: list[int]  # the request's prompt; never changes
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # generated so far
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)  # block table: block i holds tokens [i*bs, (i+1)*bs)
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (or prefilled remotely) at admission
    num_tier_loaded_tokens: int = 0  # of num_cached_tokens, those loaded from a lower KV tier (host, disk)
    arrival_order: int = 0  # set by the batcher on add; preemption picks the highest (newest) running one
    num_preemptions: int = 0  # times its blocks were taken back (recompute cost, for metrics)
    finish_reason: FinishReason | None = None  # set when the batcher drops it
    last_logprobs: TokenLogprobs | None = None  # logprobs of the newest output token, if requested
    # A held prefill of an n > 1 request: its first token is also sampled under each of these, one per
    # sibling choice (the decode worker forks the choices from its KV).
    choice_samplings: tuple[SamplingParams, ...] = ()
    # prompt + outputs, kept alongside the two lists so decode steps never concatenate them.
    _token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self._token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs. A live list owned by the sequence: read it, never mutate it."""
        return self._token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def num_pending_tokens(self) -> int:
        """Known tokens whose KV is not computed yet: 1 for a decode, more while (re)prefilling."""
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)
        self.last_logprobs = logprobs
