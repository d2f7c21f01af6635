"""`SamplingParams.prior_output_tokens` (a migrated generation): the continuation samples as the
uninterrupted request would have, although its earlier output now sits at the end of its prompt."""

from __future__ import annotations

import pytest
import torch

from engine.batch import ScheduledChunk
from engine.errors import InvalidRequestError
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 64
PROMPT = (5, 6, 7)


def chunk(params: SamplingParams, prompt: tuple[int, ...], output: tuple[int, ...]) -> ScheduledChunk:
    tokens = prompt + output
    return ScheduledChunk(request_id="r", token_ids=tokens[-1:], start_pos=len(tokens) - 1, block_ids=(0,),
                          needs_sample=True, sampling=params, prompt_token_ids=list(prompt),
                          output_token_ids=list(output))


def token(logits: torch.Tensor, row: ScheduledChunk) -> int:
    return Sampler(seed=0).sample(logits, [row])[0].token_id


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.8, seed=9, frequency_penalty=2.0),
])
def test_a_migrated_request_samples_as_the_uninterrupted_one(params: SamplingParams) -> None:
    for step in range(1, 12):
        output = tuple(range(10, 10 + step))  # generated so far
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(step))
        uninterrupted = token(logits, chunk(params, PROMPT, output))
        for seam in range(1, step + 1):  # the worker died after `seam` tokens
            moved = SamplingParams(**{**params.__dict__, "prior_output_tokens": seam})
            assert token(logits, chunk(moved, PROMPT + output[:seam], output[seam:])) == uninterrupted


def test_without_it_the_seeded_noise_restarts() -> None:
    """The reason the field exists: a plain re-prompt draws the noise of position 0 again."""
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.zeros(1, VOCAB)  # uniform: only the noise decides
    output = tuple(range(10, 16))
    differs = [token(logits, chunk(params, PROMPT, output[:n])) != token(logits, chunk(params, PROMPT + output[:n], ()))
               for n in range(1, 6)]
    assert any(differs)


def test_it_is_validated() -> None:
    with pytest.raises(InvalidRequestError, match="prior_output_tokens"):
        SamplingParams(prior_output_tokens=-1)
