"""The fused MoE kernel (engine/kernels/fused_moe.py) under triton's CPU interpreter, against the torch
reference expert compute (engine/layers/moe_ops.py).

Tiny shapes with the awkward cases: hidden and intermediate sizes that are not multiples of the
kernel's 64-wide tiles (masked tails), experts no token chose, an expert chosen by most tokens (a
group of several blocks), one token (decode) and NaN-poisoned expectations of full coverage. Every
launch configuration the table (engine/kernels/fused_moe_configs.py) or `bench_moe --sweep` can pick
runs against the reference, and the one-program Triton alignment against the torch one. On a GPU
machine the compiled kernel is checked at Qwen3-30B-A3B's shape in tests/gpu/test_moe_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

fused_moe, moe_align = import_interpreted("engine.kernels.fused_moe", "engine.kernels.moe_align")

from engine.kernels.fused_moe_configs import (  # noqa: E402
    CONFIGS,
    DEFAULT_CONFIGS,
    MoeKernelConfig,
    RowsPerExpert,
    sweep_candidates,
)
from engine.kernels.kv_store import is_interpreted  # noqa: E402
from engine.layers.moe_ops import expert_outputs_reference  # noqa: E402

HIDDEN, INTER, EXPERTS = 40, 24, 6


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _weights(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    return w13.to(dtype), w2.to(dtype)


def _skewed_ids(tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """Expert 0 for most tokens (a group spanning blocks), expert 5 never chosen."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for t in range(tokens):
        others = (torch.randperm(EXPERTS - 2, generator=gen) + 1)[:top_k].tolist()
        rows.append(([0] + others[: top_k - 1]) if t % 4 else others[:top_k])
    return torch.tensor(rows, dtype=torch.int64)


ALL_CONFIGS = list(dict.fromkeys([*DEFAULT_CONFIGS.values(), *CONFIGS.values(),
                                   *(c for rows in RowsPerExpert for c in sweep_candidates(rows))]))


def test_kernels_are_interpreted() -> None:
    assert is_interpreted(fused_moe._grouped_gemm_kernel) and is_interpreted(moe_align._align_kernel)


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [
    (1, 2, EXPERTS, 16), (25, 2, EXPERTS, 16), (25, 3, EXPERTS, 64), (40, 2, 8, 16), (0, 2, EXPERTS, 16)])
def test_one_program_alignment_equals_the_torch_alignment(tokens: int, top_k: int, experts: int,
                                                          block_m: int) -> None:
    ids = _skewed_ids(tokens, top_k, seed=tokens) if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    fused = moe_align.align_slots_to_experts_fused(ids, experts, block_m)
    torch_ = moe_align.align_slots_to_experts_torch(ids, experts, block_m)
    assert torch.equal(fused.num_padded_rows, torch_.num_padded_rows)
    assert torch.equal(fused.sorted_slots, torch_.sorted_slots)  # rows past the end too: padding ids
    used_blocks = int(torch_.num_padded_rows.item()) // block_m
    assert torch.equal(fused.block_experts[:used_blocks], torch_.block_experts[:used_blocks])
    assert (fused.block_experts[used_blocks:] >= experts).all()  # past the end: no expert (GEMMs skip them)


def test_one_token_is_aligned_without_sorting_each_slot_its_own_block() -> None:
    ids = torch.tensor([[4, 0, 2]])
    align = moe_align.align_slots_to_experts(ids, EXPERTS, 16)
    assert align.block_experts.data_ptr() == ids.data_ptr()  # the ids themselves: nothing computed
    assert align.sorted_slots.view(3, 16)[:, 0].tolist() == [0, 1, 2]
    assert (align.sorted_slots.view(3, 16)[:, 1:] == 3).all() and int(align.num_padded_rows.item()) == 48


def test_large_inputs_take_the_torch_alignment(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _skewed_ids(25, 2, seed=3)
    monkeypatch.setattr(moe_align, "FUSED_ALIGN_MAX_SLOTS", 49)
    monkeypatch.setattr(moe_align, "align_slots_to_experts_fused", None)  # would raise if called
    align = moe_align.align_slots_to_experts(ids, EXPERTS, 16)
    assert align.num_slots == 50 and int(align.num_padded_rows.item()) % 16 == 0


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_every_config_matches_the_reference(config: MoeKernelConfig) -> None:
    w13, w2 = _weights(torch.float32, seed=11)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids = _skewed_ids(9, 2, seed=4)
    got = fused_moe.fused_expert_outputs(x, ids, w13, w2, config)
    torch.testing.assert_close(got, expert_outputs_reference(x, ids, w13, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [25, 1])
def test_alignment_puts_every_slot_once_in_single_expert_blocks(tokens: int) -> None:
    ids = _skewed_ids(tokens, 2, seed=tokens)
    align = fused_moe.align_slots_to_experts(ids, EXPERTS, block_m=16)
    used = int(align.num_padded_rows.item())
    slots = align.sorted_slots[:used].view(-1, 16)
    real = slots[slots < align.num_slots]
    assert sorted(real.tolist()) == list(range(tokens * 2))  # each (token, slot) exactly once
    for block, expert in zip(slots, align.block_experts[: used // 16].tolist(), strict=True):
        members = block[block < align.num_slots].long()
        assert members.numel() > 0 and (ids.view(-1)[members] == expert).all()
    assert (align.sorted_slots[used:] == align.num_slots).all() and (align.block_experts[used // 16:] >= EXPERTS).all()


@pytest.mark.parametrize(("dtype", "tokens", "top_k"), [(torch.float32, 25, 2), (torch.float32, 1, 3),
                                                        (torch.bfloat16, 9, 2)])
def test_fused_experts_match_the_reference(dtype: torch.dtype, tokens: int, top_k: int) -> None:
    w13, w2 = _weights(dtype, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(9)).to(dtype)
    ids = _skewed_ids(tokens, top_k, seed=tokens + 1)
    got = fused_moe.fused_expert_outputs(x, ids, w13, w2)
    expected = expert_outputs_reference(x, ids, w13, w2)
    assert got.shape == (tokens, top_k, HIDDEN) and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # the interpreter's bf16 rounding is not round-to-nearest-even (see test_fused_interpret.py)
        assert ((got.double() - expected.double()).norm() / expected.double().norm()).item() <= 2e-2


def test_wrapper_rejects_mismatched_shapes() -> None:
    w13, w2 = _weights(torch.float32, seed=1)
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_moe.fused_expert_outputs(torch.zeros(3, HIDDEN + 1), torch.zeros(3, 2, dtype=torch.int64), w13, w2)
