"""The MoE routing and combine kernels (engine/kernels/moe_route.py) under triton's CPU interpreter,
against the torch code the CPU path runs (engine/layers/moe_ops.py): same experts in the same order
(up to ties, which go to the lower expert id), weights within float32 rounding; widths that are not
powers of two."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(moe_route,) = import_interpreted("engine.kernels.moe_route")

from engine.layers.moe_ops import combine_expert_outputs_reference, route_tokens_reference  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


@pytest.mark.parametrize(("experts", "top_k", "renormalize", "dtype"), [
    (128, 8, True, torch.float32), (6, 2, False, torch.float32), (8, 2, True, torch.bfloat16),
    (60, 4, False, torch.bfloat16)])
def test_routing_matches_the_torch_routing(experts: int, top_k: int, renormalize: bool, dtype: torch.dtype) -> None:
    logits = torch.randn(7, experts, generator=torch.Generator().manual_seed(experts)).to(dtype)
    weights, ids = moe_route.route_top_k(logits, top_k, renormalize)
    expected = route_tokens_reference(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    # the same logits in the same order: bf16 logits tie often, and torch.topk breaks ties arbitrarily
    assert torch.equal(logits.gather(1, ids), logits.gather(1, expected.expert_ids))
    if dtype == torch.float32:
        assert torch.equal(ids, expected.expert_ids)
    torch.testing.assert_close(weights, expected.weights, rtol=1e-6, atol=1e-7)


def test_tied_experts_go_to_the_lower_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -3.0]])
    weights, ids = moe_route.route_top_k(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 3, 2]]
    assert weights[0, 0] == weights[0, 1] and abs(float(weights.sum()) - 1.0) < 1e-6


def test_routing_rejects_more_slots_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_route.route_top_k(torch.zeros(2, 4), 5, renormalize=False)


@pytest.mark.parametrize(("dtype", "hidden"), [(torch.float32, 40), (torch.bfloat16, 1500)])
def test_combine_matches_the_torch_weighted_sum(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    outputs = torch.randn(5, 3, hidden, generator=gen).to(dtype)
    weights = torch.rand(5, 3, generator=gen)
    got = moe_route.combine_weighted(outputs, weights)
    expected = combine_expert_outputs_reference(outputs, weights)
    assert got.dtype == dtype and got.shape == (5, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # float32 sums in another order, one rounding to bf16: at most one bf16 step apart
        torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


def test_combine_rejects_mismatched_weights() -> None:
    with pytest.raises(ValueError, match="weights"):
        moe_route.combine_weighted(torch.zeros(2, 3, 4), torch.zeros(2, 2))
