"""Run one request through an engine and report how many of its prompt tokens the prefix cache served."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def generate_counting_cached(engine: LLMEngine, request_id: str, prompt: list[int],
                             params: SamplingParams) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens found in the prefix cache)."""
    engine.add_request(request_id, prompt, params)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached
