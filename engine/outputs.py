"""What the engine hands back to its callers after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass

from engine.batch import SampledToken, TokenLogprobs
from tokenization.finish_reason import FinishReason  # defined on the ground floor: the gateway speaks it too


@dataclass(frozen=True)
class HeldBlocks:
    """A finished prefill's block table kept alive for a KV transfer (see LLMEngine.add_request)."""

    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens this engine's own prefix cache served
    expires_at: float  # on the engine's clock
    # Per block of `block_ids` (engine/kv_integrity.py), computed in the step that finished the
    # prefill when the request asked for them; None otherwise.
    checksums: tuple[int, ...] | None = None
    started_at: float = 0.0  # engine clock: its first chunk was scheduled (queue wait ended)
    finished_at: float = 0.0  # engine clock: the step that sampled its first token resolved


@dataclass(frozen=True)
class RequestOutput:
    """The delta produced for one request by one step (tokens are never repeated across outputs)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str  # incremental, valid UTF-8; held back while it may still become a stop string
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or a remote prefill)
    num_tier_loaded_tokens: int = 0  # of those, loaded from host memory or disk (KV tiers)
    error: str | None = None
    held: HeldBlocks | None = None  # a hold request's only output: the blocks now held for its transfer
    # A held request's sibling choices (n > 1): their first tokens, one per `choice_samplings` entry.
    choice_first: tuple[SampledToken, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
