"""The FP8 KV cache through the Triton kernels under triton's CPU interpreter, against the torch reference:
the stores (plain and fused with RoPE) write the reference's e4m3 bytes, and decode and prefill attention
over an FP8 cache with per-layer K/V scales compute what the reference computes. On a GPU machine the
compiled kernels are checked in tests/gpu/test_fp8_kernels.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.e4m3_bytes import same_bytes_but_for_interpreter_rounding
from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

kv_store, rope_kv_store, triton_backend = import_interpreted(
    "engine.kernels.kv_store", "engine.kernels.rope_kv_store", "engine.attention.triton_backend")

from engine.attention.base import KVScale  # noqa: E402
from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.unit.engine.paged_harness import BlockPool, build_metadata  # noqa: E402

FP8 = torch.float8_e4m3fn
SCALE = KVScale(k=0.05, v=0.02)
HEADS, GROUP, DIM, BLOCK, LAYERS, NUM_BLOCKS = 2, 2, 32, 4, 2, 40


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def _fp8_cache() -> torch.Tensor:
    return torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK, HEADS, DIM, dtype=FP8)


def test_store_kv_writes_the_reference_e4m3_bytes_and_saturates_outliers() -> None:
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 6, HEADS, DIM, generator=gen)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 30.0, -30.0])  # past 448 * 0.05: must saturate, not NaN
    slots = torch.tensor([3, 17, 0, 9, 40, 41])
    cache, ref = _fp8_cache(), _fp8_cache()
    kv_store.store_kv(cache, 1, key, value, slots, SCALE.k, SCALE.v)
    TorchAttentionBackend().write_kv(ref, 1, key, value, slots, SCALE)
    assert same_bytes_but_for_interpreter_rounding(cache, ref)
    stored = cache[0, 1, 0, 3, 0, :4].float() * SCALE.k
    assert stored.tolist() == pytest.approx([448 * 0.05, -448 * 0.05, 22.4, -22.4], rel=1e-6)


def test_rope_kv_store_writes_the_reference_e4m3_bytes() -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = 5
    q = torch.randn(tokens, HEADS * GROUP, DIM, generator=gen)
    k, v = torch.randn(2, tokens, HEADS, DIM, generator=gen)
    rope = RotaryEmbedding(DIM, max_position=64, theta=10000.0, scaling=None)(torch.tensor([0, 3, 17, 40, 63]),
                                                                              torch.float32)
    slots = torch.tensor([5, 2, 0, 22, 9])
    cache, ref = _fp8_cache(), _fp8_cache()
    out = rope_kv_store.rope_and_store_kv(cache, 0, q, k, v, *rope, slots, SCALE.k, SCALE.v)
    ref_q = TorchAttentionBackend().rotate_and_write_kv(ref, 0, q, k, v, rope, slots, SCALE)
    torch.testing.assert_close(out, ref_q, rtol=1e-6, atol=1e-6)
    assert same_bytes_but_for_interpreter_rounding(cache, ref)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1]], ids=["decode_only", "mixed"])
def test_attention_over_an_fp8_cache_matches_the_reference(query_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(3)
    cached = [37, 12, 20]
    pool = BlockPool(NUM_BLOCKS, seed=4)
    tables = [pool.take(-(-(c + q) // BLOCK)) for c, q in zip(cached, query_lens, strict=True)]
    prefix_meta, _ = build_metadata(tables, [0, 0, 0], cached, BLOCK)
    meta, _ = build_metadata(tables, cached, query_lens, BLOCK)
    cache = _fp8_cache()
    ref = TorchAttentionBackend()
    prefix_k, prefix_v = torch.randn(2, sum(cached), HEADS, DIM, generator=gen)
    ref.write_kv(cache, 1, prefix_k, prefix_v, prefix_meta.slot_mapping, SCALE)
    new_k, new_v = torch.randn(2, sum(query_lens), HEADS, DIM, generator=gen)
    # The reference stores for both (the stores are compared above, with the interpreter's rounding slip).
    ref.write_kv(cache, 1, new_k, new_v, meta.slot_mapping, SCALE)
    query = torch.randn(sum(query_lens), HEADS * GROUP, DIM, generator=gen)
    out = triton_backend.TritonAttentionBackend(decode_num_splits=2).attend(query, cache, 1, meta, DIM**-0.5, SCALE)
    expected = ref.attend(query, cache, 1, meta, DIM**-0.5, SCALE)
    assert ((out.double() - expected.double()).norm() / expected.double().norm()).item() < 1e-5
