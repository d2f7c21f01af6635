"""N-gram drafting (prompt lookup) and draft verification: exact for greedy rows, and rejection
sampling for sampled rows (acceptance with probability p(draft), corrections from the residual)."""

from __future__ import annotations

import pytest
import torch

from engine.batch import SampledToken, ScheduledChunk
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.speculative import NgramProposer
from engine.speculative.verify import accept_drafts, verification_rows


# ---- n-gram proposer --------------------------------------------------------------------------------
def test_draft_continues_the_earlier_occurrence_of_the_suffix() -> None:
    p = NgramProposer(2, 3)
    assert p.propose("r", [1, 2, 3, 4, 5, 6, 9, 2, 3], 3) == (4, 5, 6)


def test_no_earlier_occurrence_gives_no_draft() -> None:
    assert NgramProposer(2, 3).propose("r", [1, 2, 3, 4, 5], 4) == ()


def test_longest_matching_ngram_wins_over_a_later_shorter_one() -> None:
    tokens = [7, 2, 3, 40, 8, 2, 3, 50, 7, 2, 3]  # (7, 2, 3) -> 40; the later (2, 3) -> 50
    assert NgramProposer(2, 3).propose("r", tokens, 1) == (40,)
    assert NgramProposer(2, 2).propose("r", tokens, 1) == (50,)


def test_latest_occurrence_wins_among_equal_lengths() -> None:
    assert NgramProposer(2, 2).propose("r", [1, 2, 10, 1, 2, 20, 1, 2], 1) == (20,)


def test_draft_is_cut_at_k_and_at_the_end_of_the_sequence() -> None:
    p = NgramProposer(1, 1)
    assert p.propose("r", [5, 6, 7, 8, 5], 2) == (6, 7)
    assert p.propose("s", [5, 6, 5], 4) == (6, 5)


def test_state_follows_appended_tokens() -> None:
    p = NgramProposer(2, 2)
    tokens = [1, 2, 3, 4]
    assert p.propose("r", tokens, 2) == ()
    tokens += [1, 2]
    assert p.propose("r", tokens, 2) == (3, 4)
    tokens += [3, 9, 3, 9]  # (3, 9) last seen followed by 3
    assert p.propose("r", tokens, 1) == (3,)


def test_forget_drops_the_table() -> None:
    p = NgramProposer(2, 2)
    p.propose("r", [1, 2, 3, 1, 2], 1)  # indexes (3, 1) -> 4
    p.forget("r")
    assert p.propose("r", [3, 1, 7, 7, 3, 1], 1) == (7,)  # a stale table would answer (3,)


def test_invalid_ngram_range_is_refused() -> None:
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---- verification -----------------------------------------------------------------------------------
def chunk(rid: str, draft: tuple[int, ...], params: SamplingParams, outputs: tuple[int, ...] = (9,)) -> ScheduledChunk:
    return ScheduledChunk(rid, (outputs[-1], *draft), 10, (0, 1, 2), True, params, [1, 2, 3], list(outputs),
                          num_draft_tokens=len(draft))


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(("sampled", "accepted", "then"), [
    ((5, 6, 7, 8), (5, 6, 7), 8),  # all accepted: the last row's token is a bonus
    ((5, 1, 7, 8), (5,), 1),  # first mismatch: its row's token is the correction
    ((2, 6, 7, 8), (), 2),
])
def test_greedy_accepts_the_longest_agreeing_prefix(sampled, accepted, then) -> None:
    c = chunk("a", (5, 6, 7), GREEDY)
    result = accept_drafts([c], [SampledToken(t) for t in sampled])
    assert tuple(t.token_id for t in result.accepted["a"]) == accepted
    assert result.sampled["a"].token_id == then


def test_rows_of_a_draft_see_their_position_in_the_output() -> None:
    c = chunk("a", (5, 6), GREEDY, outputs=(8, 9))
    plain = chunk("b", (), GREEDY)
    rows = verification_rows([c, plain])
    assert [list(r.output_token_ids) for r in rows] == [[8, 9], [8, 9, 5], [8, 9, 5, 6], [9]]
    assert all(r.num_draft_tokens == 0 for r in rows)


def test_chunks_without_drafts_get_no_accepted_entry() -> None:
    result = accept_drafts([chunk("b", (), GREEDY)], [SampledToken(4)])
    assert result.accepted == {} and result.sampled["b"].token_id == 4


def test_a_row_count_mismatch_is_refused() -> None:
    with pytest.raises(ValueError):
        accept_drafts([chunk("a", (5,), GREEDY)], [SampledToken(5)])


def test_rejection_sampling_accepts_with_p_and_corrects_from_the_residual() -> None:
    """A point-mass draft d is accepted with probability p(d); a rejected one is replaced by a token
    drawn from p without d, renormalised."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draft, n = 2, 6000
    params = SamplingParams(temperature=1.0)
    chunks = [chunk(f"r{i}", (draft,), params) for i in range(n)]
    logits = probs.log().repeat(2 * n, 1)  # both rows of every chunk: p
    tokens = Sampler(seed=1).sample(logits, verification_rows(chunks))
    result = accept_drafts(chunks, tokens)
    n_acc = sum(1 for c in chunks if result.accepted[c.request_id])
    assert abs(n_acc / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5
    rejected = [result.sampled[c.request_id].token_id for c in chunks if not result.accepted[c.request_id]]
    assert draft not in rejected
    counts = torch.bincount(torch.tensor(rejected), minlength=4).double() / len(rejected)
    expected = torch.tensor([0.1, 0.2, 0.0, 0.4]) / 0.7
    assert torch.allclose(counts, expected.double(), atol=0.03)


def test_a_seeded_row_draws_the_noise_of_its_output_position() -> None:
    """Row j of a draft samples like the plain decode at that position would: the same seed gives
    the same token with or without speculation."""
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    spec = Sampler().sample(logits, verification_rows([chunk("a", (5, 6), params, outputs=(8, 9))]))
    plain = [Sampler().sample(logits[j:j + 1], [chunk("a", (), params, outputs=(8, 9, 5, 6)[:2 + j])])[0]
             for j in range(3)]
    assert [t.token_id for t in spec] == [t.token_id for t in plain]
