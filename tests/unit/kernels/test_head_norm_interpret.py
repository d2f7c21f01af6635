"""The per-head RMSNorm kernel (engine/kernels/head_norm.py, Qwen3's q/k norm) under triton's CPU
interpreter, against the torch reference (`RMSNorm.normalize`'s torch path) on q and k read in place
from a QKV projection's output (strided views), and with a head size that is not a power of two."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

(head_norm,) = import_interpreted("engine.kernels.head_norm")

from engine.layers.norm import RMSNorm  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _norm(head_dim: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(head_dim, generator=torch.Generator().manual_seed(head_dim)) + 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 24)])
def test_strided_q_and_k_match_the_torch_norm(dtype: torch.dtype, head_dim: int) -> None:
    tokens, q_heads, kv_heads = 5, 4, 2
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(1))
           * 3).to(dtype)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    for x, heads in ((q, q_heads), (k, kv_heads)):
        view = x.view(tokens, heads, head_dim)
        assert not view.is_contiguous()
        norm = _norm(head_dim, dtype)
        got = head_norm.rmsnorm_heads(view, norm.weight, norm.eps)
        expected = norm._norm(view)
        assert got.shape == view.shape and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        else:  # the interpreter's float32 -> bf16 cast does not round to nearest even (test_fused_interpret.py)
            assert ((got.double() - expected.double()).norm() / expected.double().norm()).item() <= 1e-2


def test_rejects_a_weight_of_another_width() -> None:
    with pytest.raises(ValueError, match="weight"):
        head_norm.rmsnorm_heads(torch.zeros(2, 3, 8), torch.ones(4), 1e-6)
