"""`RequestIntake`: a new request's checks against the model, and the engine-side state built for it.

The batcher checks its sequences again (engine/sequence_checks.py) against its own limits (the KV
pool); these checks are the engine's: the vocabulary, the context window, the sampling settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tracked_request import TrackedRequest
from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.tokenizer import Tokenizer


class RequestIntake:
    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer | None, max_model_len: int,
                 default_num_draft_tokens: int) -> None:
        """`default_num_draft_tokens`: the drafts of a request that leaves `num_draft_tokens` None."""
        self._vocab_size = model_config.vocab_size
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._default_num_draft_tokens = default_num_draft_tokens
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos.update(tokenizer.eos_token_ids)
        self._eos_ids = frozenset(eos)

    def check(self, request_id: str, prompt: list[int], params: SamplingParams, known_ids: Container[str]) -> None:
        """Raise InvalidRequestError naming the problem: a duplicate id, an empty prompt, a prompt that
        leaves no room to generate, a token outside the vocabulary, or bad sampling settings."""
        if request_id in known_ids:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if not isinstance(params, SamplingParams):  # before the checks below read its fields
            raise InvalidRequestError("params must be a SamplingParams")
        if not prompt:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        if len(prompt) >= self._max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; the context window is {self._max_model_len} tokens "
                "and at least one must be left to generate"
            )
        if params.prior_output_tokens >= len(prompt):
            raise InvalidRequestError(f"prior_output_tokens ({params.prior_output_tokens}) must be shorter than "
                                      f"the prompt ({len(prompt)} tokens)")
        vocab = self._vocab_size
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")

    def track(self, request_id: str, prompt: list[int], params: SamplingParams) -> TrackedRequest:
        """The state of a checked request: its sequence (the speculative setting resolved), its
        detokenizer (None without a tokenizer) and its stop token ids."""
        if params.guided is not None:  # the grammar advances one accepted token at a time: never drafts
            params = dataclasses.replace(params, num_draft_tokens=0)
        elif params.num_draft_tokens is None:
            params = dataclasses.replace(params, num_draft_tokens=self._default_num_draft_tokens)
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt), sampling=params)
        detok = None
        if self._tokenizer is not None:
            detok = IncrementalDetokenizer(self._tokenizer, list(prompt), params.stop)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        return TrackedRequest(seq, detok, stop_ids)
