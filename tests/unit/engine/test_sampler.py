"""Behaviour of the batched sampler: which tokens come out, with which frequencies and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from engine.batch import ScheduledChunk
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def chunk(params: SamplingParams = GREEDY, prompt: tuple[int, ...] = (0,),
          output: tuple[int, ...] = (), request_id: str = "r") -> ScheduledChunk:
    tokens = prompt + output
    return ScheduledChunk(request_id=request_id, token_ids=tokens[-1:], start_pos=len(tokens) - 1,
                          block_ids=(0,), needs_sample=True, sampling=params,
                          prompt_token_ids=list(prompt), output_token_ids=list(output))


def sample_ids(logits: torch.Tensor, chunks: list[ScheduledChunk], seed: int = 0) -> list[int]:
    return [t.token_id for t in Sampler(seed=seed).sample(logits, chunks)]


def draw(logits_row: list[float], params: SamplingParams, n: int = 20_000) -> Counter[int]:
    """n independent draws from one distribution, as one batch of n identical unseeded rows."""
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(n, -1).contiguous()
    return Counter(sample_ids(logits, [chunk(params)] * n))


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def chi_square(counts: Counter[int], expected: list[float]) -> float:
    n = sum(counts.values())
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))


# --- greedy -----------------------------------------------------------------------------------------

def test_greedy_rows_return_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    assert sample_ids(logits, [chunk() for _ in range(8)]) == logits.argmax(dim=-1).tolist()


def test_sample_leaves_input_logits_unchanged() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    sample_ids(logits, [chunk(SamplingParams(repetition_penalty=2.0, top_k=3)), chunk()])
    assert torch.equal(logits, before)


def test_mismatched_rows_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_chunks=2"):
        Sampler().sample(torch.zeros(3, 5), [chunk(), chunk()])


# --- temperature and filters ------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    row = [2.0, 1.0, 0.5, 0.0, -1.0]
    counts = draw(row, SamplingParams(temperature=temperature))
    expected = torch.tensor(row).div(temperature).softmax(-1).tolist()
    assert chi_square(counts, expected) < 20.0  # 4 degrees of freedom: p < 0.001


def test_top_k_never_samples_outside_the_top_k() -> None:
    row = [0.1, 3.0, -2.0, 2.5, 0.0, 2.0, 1.0, -1.0]
    counts = draw(row, SamplingParams(temperature=5.0, top_k=3), n=5_000)
    assert set(counts) == {1, 3, 5}


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.4, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2})])
def test_top_p_keeps_the_minimal_nucleus(top_p: float, nucleus: set[int]) -> None:
    counts = draw(log_probs(0.5, 0.3, 0.15, 0.05), SamplingParams(top_p=top_p))
    assert set(counts) == nucleus


def test_top_p_renormalizes_within_the_nucleus() -> None:
    counts = draw(log_probs(0.5, 0.3, 0.15, 0.05), SamplingParams(top_p=0.75))
    assert chi_square(counts, [0.5 / 0.8, 0.3 / 0.8]) < 11.0  # 1 degree of freedom: p < 0.001


def test_top_p_is_computed_after_top_k() -> None:
    # Top-2 renormalizes to (0.625, 0.375); a top_p of 0.6 then keeps only the best token.
    counts = draw(log_probs(0.5, 0.3, 0.15, 0.05), SamplingParams(top_k=2, top_p=0.6), n=2_000)
    assert set(counts) == {0}


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.7, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p: float, kept: set[int]) -> None:
    counts = draw(log_probs(0.5, 0.3, 0.15, 0.05), SamplingParams(min_p=min_p))
    assert set(counts) == kept


# --- penalties (greedy flips exactly at the formula's boundary) -------------------------------------

def greedy_with(params: SamplingParams, row: list[float], prompt: tuple[int, ...] = (9,),
                output: tuple[int, ...] = ()) -> int:
    logits = torch.tensor([row + [-10.0] * 8], dtype=torch.float32)  # ids 2..9: never chosen
    return sample_ids(logits, [chunk(params, prompt=prompt, output=output)])[0]


@pytest.mark.parametrize(("penalty", "expected"), [(1.9, 0), (2.1, 1)])
def test_repetition_penalty_divides_positive_logits(penalty: float, expected: int) -> None:
    # 2.0 / 1.9 > 1.0 > 2.0 / 2.1
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert greedy_with(params, [2.0, 1.0], prompt=(0,)) == expected


@pytest.mark.parametrize(("penalty", "expected"), [(1.4, 0), (1.6, 1)])
def test_repetition_penalty_multiplies_negative_logits(penalty: float, expected: int) -> None:
    # -1.0 * 1.4 > -1.5 > -1.0 * 1.6
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert greedy_with(params, [-1.0, -1.5], output=(0,)) == expected


def test_repetition_penalty_counts_prompt_and_output_once() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.9)
    # Seen in both, several times: still divided once (2.0 / 1.9 > 1.0).
    assert greedy_with(params, [2.0, 1.0], prompt=(0, 0), output=(0, 0, 0)) == 0


@pytest.mark.parametrize(("penalty", "expected"), [(0.3, 0), (0.4, 1)])
def test_frequency_penalty_subtracts_per_occurrence(penalty: float, expected: int) -> None:
    # Three occurrences: 3.0 - 0.9 > 2.0 > 3.0 - 1.2
    params = SamplingParams(temperature=0.0, frequency_penalty=penalty)
    assert greedy_with(params, [3.0, 2.0], output=(0, 0, 0)) == expected


@pytest.mark.parametrize(("penalty", "expected"), [(0.9, 0), (1.1, 1)])
def test_presence_penalty_subtracts_once_whatever_the_count(penalty: float, expected: int) -> None:
    # Three occurrences but one subtraction: 3.0 - 0.9 > 2.0 > 3.0 - 1.1
    params = SamplingParams(temperature=0.0, presence_penalty=penalty)
    assert greedy_with(params, [3.0, 2.0], output=(0, 0, 0)) == expected


def test_negative_presence_penalty_favours_generated_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=-1.5)
    assert greedy_with(params, [2.0, 3.0], output=(0,)) == 0


def test_presence_and_frequency_penalties_ignore_the_prompt() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert greedy_with(params, [3.0, 2.0], prompt=(0, 0, 0)) == 0


def test_penalties_apply_only_to_their_own_row() -> None:
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0]])
    penalized = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    rows = [chunk(penalized, prompt=(0,)), chunk(GREEDY, prompt=(0,), output=(0, 0))]
    assert sample_ids(logits, rows) == [1, 0]


def test_penalty_token_outside_the_vocab_is_rejected() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    with pytest.raises(ValueError, match="penalty token ids"):
        Sampler().sample(torch.zeros(1, 4), [chunk(params, prompt=(4,))])


# --- seeds --------------------------------------------------------------------------------------------

VOCAB = 64
SEEDED = SamplingParams(temperature=1.0, seed=1234)


BatchLayout = Callable[[ScheduledChunk], list[ScheduledChunk]]  # places the seeded chunk among others


def seeded_tokens(batch_of: BatchLayout, steps: int = 12, engine_seed: int = 0) -> list[int]:
    """The seeded request's token at each position when batched as `batch_of(seeded_chunk)` lays out."""
    torch_gen = torch.Generator().manual_seed(99)
    sampler, tokens = Sampler(seed=engine_seed), []
    for step in range(steps):
        target = chunk(SEEDED, output=tuple(range(step)), request_id="target")
        rows = batch_of(target)
        logits = torch.randn(len(rows), VOCAB, generator=torch_gen)
        # The target row's logits depend only on the step, like a model's would.
        logits[rows.index(target)] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))
        result = sampler.sample(logits, rows)
        tokens.append(result[rows.index(target)].token_id)
    return tokens


def others() -> list[ScheduledChunk]:
    return [chunk(SamplingParams(), request_id="a"), chunk(GREEDY, request_id="b"),
            chunk(SamplingParams(seed=7, top_k=5), request_id="c")]


def test_seeded_row_is_independent_of_batch_composition_and_order() -> None:
    alone = seeded_tokens(lambda t: [t])
    assert seeded_tokens(lambda t: [*others(), t]) == alone
    assert seeded_tokens(lambda t: [t, *reversed(others())]) == alone
    assert seeded_tokens(lambda t: [others()[0], t], engine_seed=5) == alone


def test_seeded_row_repeats_after_recompute() -> None:
    # Stateless noise: re-sampling the same position (e.g. after preemption) gives the same token.
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, VOCAB)
    row = [chunk(SEEDED, output=(1, 2, 3))]
    first = [sampler.sample(logits, row)[0].token_id for _ in range(5)]
    assert len(set(first)) == 1


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: any difference comes from the noise
    by_seed = [[sample_ids(logits, [chunk(SamplingParams(seed=s), output=(0,) * n)])[0] for n in range(10)]
               for s in (1, 2)]
    assert by_seed[0] != by_seed[1]


def test_seeded_noise_changes_with_position() -> None:
    logits = torch.zeros(1, VOCAB)
    tokens = [sample_ids(logits, [chunk(SEEDED, output=(0,) * n)])[0] for n in range(10)]
    assert len(set(tokens)) > 1


def test_engine_seed_makes_unseeded_rows_reproducible() -> None:
    logits = torch.zeros(4, VOCAB)
    rows = [chunk(SamplingParams()) for _ in range(4)]
    assert sample_ids(logits, rows, seed=3) == sample_ids(logits, rows, seed=3)


# --- logprobs -----------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, logprobs=5)
    [token] = Sampler(seed=0).sample(logits, [chunk(params, prompt=(1, 2))])
    expected = logits.log_softmax(-1)[0]
    lp = token.logprobs
    assert lp.token_id == token.token_id
    assert lp.logprob == pytest.approx(expected[token.token_id].item())
    top_ids = expected.argsort(descending=True)[:5].tolist()
    assert [i for i, _ in lp.top] == top_ids
    assert [v for _, v in lp.top] == pytest.approx(expected[top_ids].tolist())


def test_logprobs_zero_returns_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    [token] = Sampler().sample(logits, [chunk(SamplingParams(temperature=0.0, logprobs=0))])
    assert token.logprobs.top == ()
    assert token.logprobs.logprob == pytest.approx(logits.log_softmax(-1)[0, 2].item())


def test_logprobs_only_for_rows_that_ask() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(2))
    rows = [chunk(SamplingParams(logprobs=2)), chunk(GREEDY),
            chunk(SamplingParams(temperature=0.0, logprobs=4))]
    tokens = Sampler().sample(logits, rows)
    assert [len(t.logprobs.top) if t.logprobs else None for t in tokens] == [2, None, 4]


# --- mixed batch --------------------------------------------------------------------------------------

def test_mixed_batch_of_greedy_sampled_and_seeded_rows() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    greedy, top_k, seeded = chunk(GREEDY), chunk(SamplingParams(top_k=2)), chunk(SEEDED, output=(5,))
    tokens = sample_ids(logits, [greedy, top_k, seeded])
    assert tokens[0] == logits[0].argmax().item()
    assert tokens[1] in logits[1].topk(2).indices.tolist()
    assert tokens[2] == sample_ids(logits[2:], [seeded], seed=42)[0]
