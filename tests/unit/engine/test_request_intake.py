"""RequestIntake (a new request's checks and state) and the stop rules of its TrackedRequest, without a
model: each refusal names its problem, and a step's tokens are cut after the first that finishes."""

from __future__ import annotations

import pytest

from engine.batch import SampledToken
from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason
from engine.request_intake import RequestIntake
from engine.sampling_params import SamplingParams
from engine.step_outputs import read_step_tokens
from engine.structured.constraint import GrammarKind, GuidedDecoding

EOS = 2
MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64,
                    eos_token_ids=(EOS,))


def intake(default_drafts: int = 3) -> RequestIntake:
    return RequestIntake(MODEL, None, max_model_len=16, default_num_draft_tokens=default_drafts)


@pytest.mark.parametrize(("request_id", "prompt", "params", "problem"), [
    ("known", [1, 2], SamplingParams(), "duplicate request id 'known'"),
    ("r", [], SamplingParams(), "prompt is empty"),
    ("r", list(range(16)), SamplingParams(), "context window is 16 tokens"),
    ("r", [1, 2], SamplingParams(prior_output_tokens=2), "prior_output_tokens"),
    ("r", [1, 96], SamplingParams(), "token id 96 is outside the vocabulary"),
    ("r", [1, "x"], SamplingParams(), "token id 'x' is outside the vocabulary"),
    ("r", [1, 2], {"max_tokens": 4}, "params must be a SamplingParams"),
])
def test_each_bad_request_is_refused_naming_its_problem(request_id, prompt, params, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        intake().check(request_id, prompt, params, {"known"})


def test_a_request_that_fits_passes_its_checks():
    intake().check("r", list(range(15)), SamplingParams(prior_output_tokens=14), {"known"})


def test_the_speculative_default_applies_unless_set_or_guided():
    default = intake().track("a", [1], SamplingParams())
    explicit = intake().track("b", [1], SamplingParams(num_draft_tokens=1))
    json_only = GuidedDecoding(GrammarKind.JSON_OBJECT)
    guided = intake().track("c", [1], SamplingParams(guided=json_only, num_draft_tokens=4))
    assert [t.seq.sampling.num_draft_tokens for t in (default, explicit, guided)] == [3, 1, 0]


def test_stop_ids_hold_the_model_eos_unless_ignored():
    assert intake().track("a", [1], SamplingParams(stop_token_ids=(5,))).stop_ids == {5, EOS}
    assert intake().track("b", [1], SamplingParams(stop_token_ids=(5,), ignore_eos=True)).stop_ids == {5}


def _stepped(params: SamplingParams, tokens: list[int], prompt_len: int = 3):
    """A tracked request whose batcher already appended `tokens` (a step's accepted drafts + sample)."""
    tracked = intake().track("r", list(range(10, 10 + prompt_len)), params)
    for token in tokens:
        tracked.seq.append_token(token)
    return tracked, [SampledToken(t) for t in tokens]


def test_a_step_is_cut_after_its_first_stop_token():
    tracked, sampled = _stepped(SamplingParams(max_tokens=8), [7, EOS, 8])
    tokens = read_step_tokens(tracked, sampled, max_num_tokens=16)
    assert [s.token_id for s in tokens.sampled] == [7, EOS] and tokens.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(("max_tokens", "max_num_tokens", "kept"), [(2, 16, 2), (8, 5, 2), (8, 16, 3)])
def test_max_tokens_and_the_length_limit_finish_at_their_token(max_tokens, max_num_tokens, kept):
    tracked, sampled = _stepped(SamplingParams(max_tokens=max_tokens), [7, 8, 9])
    tokens = read_step_tokens(tracked, sampled, max_num_tokens)
    assert len(tokens.sampled) == kept
    assert tokens.finish_reason is (FinishReason.LENGTH if kept < 3 else None)


def test_a_held_prefill_always_finishes():
    tracked, sampled = _stepped(SamplingParams(max_tokens=8), [7])
    tracked.hold_for_s = 5.0
    assert read_step_tokens(tracked, sampled, max_num_tokens=16).finish_reason is FinishReason.LENGTH
