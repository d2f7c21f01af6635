"""What a sequence must be before the batcher takes it (queued, reserved for remote KV, or forked)."""

from __future__ import annotations

from collections.abc import Container

from engine.errors import InvalidRequestError
from engine.sequence import Sequence


def check_new_sequence(seq: Sequence, known_ids: Container[str], max_num_tokens: int, max_model_len: int) -> None:
    """Raise InvalidRequestError naming the problem: a duplicate id, an empty prompt, a prompt that
    leaves no room to generate, or a sequence that already has tokens or blocks."""
    if seq.request_id in known_ids:
        raise InvalidRequestError(f"duplicate request id {seq.request_id!r}")
    if not seq.prompt_token_ids:
        raise InvalidRequestError("prompt is empty: at least one token is required")
    if seq.num_prompt_tokens >= max_num_tokens:
        limit = "context window" if max_num_tokens == max_model_len else "KV cache"
        raise InvalidRequestError(
            f"prompt has {seq.num_prompt_tokens} tokens; the {limit} holds {max_num_tokens} "
            "tokens and at least one must be left to generate"
        )
    if seq.output_token_ids or seq.block_ids or seq.num_computed_tokens:
        raise InvalidRequestError(f"sequence {seq.request_id!r} is not new")
