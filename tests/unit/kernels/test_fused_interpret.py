"""The fused decode kernels (add+RMSNorm, SiLU·mul, RoPE+KV store) under triton's CPU interpreter,
against the torch reference code the CPU path runs (`engine/layers`, the torch attention backend).

Small shapes with the awkward cases: widths that are not powers of two, strided (sliced) inputs,
padded rows (slot -1), fresh random inputs, NaN-poisoned outputs. bf16 must match the reference to
the last rounding (the kernels round where torch does); float32 to 1e-6. On a GPU machine the
compiled kernels are tested at Llama-3.1-8B shape in tests/gpu/test_triton_kernels.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

fused_norm, silu_mul, rope_kv_store, kv_store = import_interpreted(
    "engine.kernels.fused_norm", "engine.kernels.silu_mul", "engine.kernels.rope_kv_store", "engine.kernels.kv_store")

from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def test_kernels_are_interpreted() -> None:
    for kernel in (fused_norm._add_rmsnorm_kernel, silu_mul._silu_mul_kernel, rope_kv_store._rope_kv_store_kernel):
        assert kv_store.is_interpreted(kernel)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: the same arithmetic to 1e-6. bf16: ||out - ref|| / ||ref|| <= 1e-2, because the
    interpreter's float32 -> bf16 conversion does not round to nearest even as the GPU and torch do
    (about half of all values land one ulp off); tests/gpu checks the compiled rounding tightly."""
    assert not out.isnan().any(), "an output element was never written"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_the_reference(dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    width = 72  # not a power of two: the masked tail
    norm = RMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen) + 1)
    norm = norm.to(dtype)
    x = torch.randn(5, width + 8, generator=gen).to(dtype)[:, :width]  # a strided view
    residual = torch.randn(5, width, generator=gen).to(dtype) if with_residual else None
    out, total = fused_norm.fused_add_rmsnorm(x, residual, norm.weight.detach(), norm.eps)
    with torch.no_grad():
        ref_out, ref_total = norm(x, residual)
    assert_matches(out, ref_out)
    assert_matches(total, ref_total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    width = silu_mul.BLOCK + 40  # two column blocks, the second partial
    x = (torch.randn(3, 2 * width + 6, generator=gen) * 3).to(dtype)[:, : 2 * width]
    assert_matches(silu_mul.silu_and_mul(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_store_matches_rotary_then_store(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    tokens, h_q, h_kv, d, block, blocks, layers = 5, 6, 3, 24, 4, 6, 2  # 6 and 3 heads: masked rows
    qkv = torch.randn(tokens, (h_q + 2 * h_kv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([h_q * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.view(tokens, h_q, d), k.view(tokens, h_kv, d), v.view(tokens, h_kv, d)  # strided views
    rope = RotaryEmbedding(d, max_position=64, theta=10000.0, scaling=None)(
        torch.tensor([0, 3, 17, 40, 63]), dtype)
    slots = torch.tensor([5, -1, 0, 22, 9])  # one padded row: its q is rotated, nothing is stored
    cache = torch.randn(blocks, layers, 2, block, h_kv, d, generator=gen).to(dtype)
    ref_cache = cache.clone()
    out = rope_kv_store.rope_and_store_kv(cache, 1, q, k, v, *rope, slots)
    ref_q = TorchAttentionBackend().rotate_and_write_kv(ref_cache, 1, q, k, v, rope, slots)
    # The torch backend never sees padded rows (no CUDA graphs on CPU): slot -1 indexes its last slot.
    ref_cache[-1, 1, :, -1] = cache[-1, 1, :, -1]
    assert_matches(out, ref_q)
    assert_matches(cache, ref_cache)


def test_rope_kv_store_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 1, 2, 4, 2, 16)
    q, kv = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16)
    cos, slots = torch.zeros(3, 1, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="key must be"):
        rope_kv_store.rope_and_store_kv(cache, 0, q, torch.zeros(3, 3, 16), kv, cos, cos, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_kv_store.rope_and_store_kv(cache, 0, q, kv, kv, cos, cos, torch.zeros(3, dtype=torch.int32))
