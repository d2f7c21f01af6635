"""The Triton attention kernels, run on CPU tensors by triton's interpreter, against float64 references.

TRITON_INTERPRET=1 must be set before triton's first import (its library functions such as `tl.max`
are decorated then) and while the kernels run, so this module sets it before importing anything of
triton and keeps it set while its tests run. `TRITON_INTERPRET=1 pytest ...` works as well.
It runs only where CUDA is absent: on a GPU machine the same kernels are tested compiled
(tests/gpu), and importing them interpreted there would leak slow interpreted kernels into the GPU
tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.support.required import require_module

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")


def _restore_env(previous: str | None) -> None:
    if previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous


_TRITON_WAS_IMPORTED = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"  # until the kernels below are decorated
try:
    triton = require_module("triton")
    if _TRITON_WAS_IMPORTED and type(triton.language.max).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported (compiled mode) before this module could set TRITON_INTERPRET=1, so "
                    "the kernels cannot be interpreted; run with TRITON_INTERPRET=1 in the environment",
                    pytrace=False)
    from engine.attention import triton_backend
    from engine.kernels import kv_checksum, kv_store
    from engine.kernels import paged_decode as paged_decode_mod
    from engine.kernels import paged_prefill as paged_prefill_mod
finally:
    _restore_env(_PREVIOUS_INTERPRET)

from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.block_checksum import reference_checksums  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.kernels.attention_tiles import PrefillConfig  # noqa: E402
from tests.support.paged_reference import (  # noqa: E402
    make_cache,
    meta_for,
    poisoned_like,
    random_block_tables,
    reference,
    rel_err,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _restore_env(previous)


def test_kernels_are_interpreted() -> None:
    assert kv_store.is_interpreted(paged_decode_mod._decode_split_kernel)
    assert kv_store.is_interpreted(paged_prefill_mod._prefill_kernel)
    assert kv_store.is_interpreted(kv_checksum._checksum_kernel)


def test_prefill_warm_up_launches_every_bucket_and_tile_and_leaves_the_cache_alone() -> None:
    cache = make_cache(8, 2, 4, 2, 16, torch.float32, torch.Generator().manual_seed(3))
    before = cache.clone()
    assert paged_prefill_mod.warm_up(cache, num_q_heads=4, max_num_seqs=40, dtype=torch.float32) == 12  # 3 x 2 x 2
    assert torch.equal(cache, before)


@pytest.mark.parametrize("width", [8, 4096 + 3, 3 * kv_checksum._SPLIT_WORDS // 2])
def test_checksum_kernel_matches_the_reference(width: int) -> None:
    """Extreme words (-32768, 32767) and widths that end mid-tile and span several splits."""
    gen = torch.Generator().manual_seed(width)
    words = torch.randint(-32768, 32768, (6, width), generator=gen, dtype=torch.int32).to(torch.int16)
    words[1] = -32768
    words[2] = 32767
    ids = [5, 0, 2, 1]
    assert kv_checksum.block_checksums_triton(words, ids).tolist() == reference_checksums(words, ids).tolist()


# --------------------------------------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(12, 3, 4, 2, 64, dtype, gen)
    before = cache.clone()
    slots = torch.randperm(12 * 4 - 1, generator=gen)[:9] + 1  # slot 0 stays free: a skipped row
    slots[[2, 6]] = -1  # (padded CUDA-graph row) clamped to it instead of masked would show there
    qkv = torch.randn(9, 3 * 2 * 64, generator=gen).to(dtype)  # K and V as strided views of one tensor
    key = qkv[:, 128:256].view(9, 2, 64)
    value = qkv[:, 256:].view(9, 2, 64)
    kv_store.store_kv(cache, 1, key, value, slots)
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 4, 1, 0, slot % 4] = key[t]
            expected[slot // 4, 1, 1, slot % 4] = value[t]
    assert torch.equal(cache, expected)


def test_store_kv_handles_odd_head_count_and_block_size() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = make_cache(5, 1, 3, 3, 16, torch.float32, gen)  # non power-of-two heads and block size
    key, value = torch.randn(2, 4, 3, 16, generator=gen)
    slots = torch.tensor([14, 0, 7, 8])
    kv_store.store_kv(cache, 0, key, value, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(cache[slot // 3, 0, 0, slot % 3], key[t])
        assert torch.equal(cache[slot // 3, 0, 1, slot % 3], value[t])


@pytest.mark.parametrize("bad", ["dtype", "shape", "slot_dtype", "slot_len", "layer"])
def test_store_kv_rejects_invalid_inputs_before_launch(bad: str) -> None:
    cache = torch.ones(4, 2, 2, 4, 2, 16)
    key = value = torch.ones(3, 2, 16)
    slots = torch.arange(3)
    layer = 0
    if bad == "dtype":
        key = key.half()
    elif bad == "shape":
        key = torch.ones(3, 1, 16)
    elif bad == "slot_dtype":
        slots = slots.int()
    elif bad == "slot_len":
        slots = torch.arange(2)
    else:
        layer = 2
    with pytest.raises(ValueError):
        kv_store.store_kv(cache, layer, key, value, slots)
    assert torch.equal(cache, torch.ones_like(cache))


# -------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(10 + group + num_splits)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    seq_lens = [1, 37, 16, 150]  # one token, partial last block, exactly one block, many blocks
    cache = make_cache(40, 2, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = random_block_tables(seq_lens, block_size, 40, gen)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    out = poisoned_like(query)
    paged_decode_mod.paged_decode(query, cache, 1, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                  0.125, num_splits, out=out, block_n=32)
    assert not out.isnan().any()
    assert rel_err(out, reference(query, cache, 1, tables, seq_lens, [1] * 4, 0.125)) < TOLERANCE[dtype]


def test_paged_decode_head_dim_128_small_blocks_and_empty_splits() -> None:
    """More splits than a short context has tiles: empty splits must not disturb the merge."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [5, 70]
    cache = make_cache(24, 1, 4, 1, 128, torch.float32, gen)
    tables = random_block_tables(seq_lens, 4, 24, gen)
    query = torch.randn(2, 4, 128, generator=gen)
    out = poisoned_like(query)
    paged_decode_mod.paged_decode(query, cache, 0, tables, torch.tensor(seq_lens, dtype=torch.int32),
                                  0.09, 8, out=out, block_n=16)
    assert rel_err(out, reference(query, cache, 0, tables, seq_lens, [1, 1], 0.09)) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_row_without_context_outputs_zeros(num_splits: int) -> None:
    """A padded CUDA-graph row (seq_len 0) must come out finite (zeros), whatever the split count."""
    gen = torch.Generator().manual_seed(4)
    cache = make_cache(4, 1, 16, 1, 64, torch.float32, gen)
    tables = torch.tensor([[2, 0], [0, 0]], dtype=torch.int32)
    query = torch.randn(2, 2, 64, generator=gen)
    out = poisoned_like(query)
    paged_decode_mod.paged_decode(query, cache, 0, tables, torch.tensor([20, 0], dtype=torch.int32),
                                  0.125, num_splits, out=out, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[:1], reference(query[:1], cache, 0, tables[:1], [20], [1], 0.125)) < 1e-5


def test_choose_num_splits_is_the_default_config_of_the_shape_class() -> None:
    for batch, ctx in ((1, 8192), (8, 8192), (32, 2048), (64, 4096), (1, 300), (128, None)):
        config = paged_decode_mod.decode_config(batch, 8, 132, ctx)
        assert paged_decode_mod.choose_num_splits(batch, 8, 132, ctx) == config.num_splits(batch, 8, 132, ctx)


# ------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_paged_prefill_with_cached_prefix_matches_reference(dtype: torch.dtype, group: int) -> None:
    gen = torch.Generator().manual_seed(20 + group)
    block_size, num_kv_heads, head_dim = 16, 2, 64
    seq_lens, query_lens = [53, 40], [21, 40]  # an extend over a cached prefix; a fresh prompt
    cache = make_cache(16, 1, block_size, num_kv_heads, head_dim, dtype, gen)
    tables = random_block_tables(seq_lens, block_size, 16, gen)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    out = poisoned_like(query)
    paged_prefill_mod.paged_prefill(
        query, cache, 0, tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([0, 21, 61], dtype=torch.int32), 0.125, out=out, config=PrefillConfig(16, 16, 4, 2),
    )
    assert not out.isnan().any()
    ref = reference(query, cache, 0, tables, seq_lens, query_lens, 0.125)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("group", [1, 3, 4])
def test_paged_prefill_mixed_varlen_batch_with_decode_rows(group: int) -> None:
    """Unaligned query starts, multi-tile sequences, decode rows and non power-of-two GQA groups."""
    gen = torch.Generator().manual_seed(30 + group)
    block_size, num_kv_heads, head_dim = 8, 2, 128
    seq_lens = [70, 1, 33, 96, 9]
    query_lens = [1, 1, 19, 35, 9]
    cache = make_cache(48, 2, block_size, num_kv_heads, head_dim, torch.float32, gen)
    tables = random_block_tables(seq_lens, block_size, 48, gen)
    meta = meta_for(seq_lens, query_lens, tables, block_size)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen)
    out = poisoned_like(query)
    paged_prefill_mod.paged_prefill(query, cache, 1, tables, meta.seq_lens, meta.query_start_loc, 0.08,
                                    out=out, config=PrefillConfig(32, 16, 4, 2))
    assert not out.isnan().any()
    assert rel_err(out, reference(query, cache, 1, tables, seq_lens, query_lens, 0.08)) < 1e-5


def test_head_dim_that_is_not_a_power_of_two_is_padded_and_masked() -> None:
    gen = torch.Generator().manual_seed(50)
    seq_lens, query_lens = [45, 30], [1, 30]
    cache = make_cache(8, 1, 16, 1, 80, torch.float32, gen)
    tables = random_block_tables(seq_lens, 16, 8, gen)
    meta = meta_for(seq_lens, query_lens, tables, 16)
    query = torch.randn(31, 2, 80, generator=gen)
    prefill_out, decode_out = poisoned_like(query), poisoned_like(query[:2])
    paged_prefill_mod.paged_prefill(query, cache, 0, tables, meta.seq_lens, meta.query_start_loc, 0.1,
                                    out=prefill_out, config=PrefillConfig(16, 16, 4, 2))
    assert rel_err(prefill_out, reference(query, cache, 0, tables, seq_lens, query_lens, 0.1)) < 1e-5
    decode_query = query[[0, 30]]
    paged_decode_mod.paged_decode(decode_query, cache, 0, tables, meta.seq_lens, 0.1, 2, out=decode_out,
                                  block_n=16)
    assert rel_err(decode_out, reference(decode_query, cache, 0, tables, seq_lens, [1, 1], 0.1)) < 1e-5


def test_unsupported_head_dim_is_rejected_with_the_valid_range() -> None:
    with pytest.raises(ConfigError, match="16..256"):
        paged_decode_mod.paged_decode(torch.ones(1, 1, 8), torch.ones(2, 1, 2, 16, 1, 8), 0,
                                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                      0.1, 1)


def test_paged_prefill_rejects_mismatched_metadata() -> None:
    cache = torch.ones(4, 1, 2, 16, 2, 64)
    query = torch.ones(5, 4, 64)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_mod.paged_prefill(query, cache, 0, tables, torch.tensor([3, 2], dtype=torch.int32),
                                        torch.tensor([0, 5], dtype=torch.int32), 0.1)


# ------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 12, 1]], ids=["decode_only", "mixed"])
def test_triton_backend_matches_torch_backend_end_to_end(query_lens: list[int]) -> None:
    """write_kv then attend, through the backends' own interface, for a decode step and a mixed step."""
    gen = torch.Generator().manual_seed(40)
    block_size, num_kv_heads, group, head_dim = 16, 2, 2, 64
    seq_lens = [90, 12, 33]
    cache = make_cache(24, 2, block_size, num_kv_heads, head_dim, torch.float32, gen)
    tables = random_block_tables(seq_lens, block_size, 24, gen)
    meta = meta_for(seq_lens, query_lens, tables, block_size)
    num_tokens = sum(query_lens)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    outs = []
    for backend in (triton_backend.TritonAttentionBackend(decode_num_splits=2), TorchAttentionBackend()):
        kv = cache.clone()
        backend.write_kv(kv, 1, key, value, meta.slot_mapping)
        outs.append((kv, backend.attend(query, kv, 1, meta, 0.125)))
    (kv_triton, out_triton), (kv_torch, out_torch) = outs
    assert torch.equal(kv_triton, kv_torch)
    assert rel_err(out_triton, out_torch.double()) < 1e-5


def test_triton_backend_rejects_decode_step_with_wrong_row_count() -> None:
    seq_lens = [5, 6]
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    meta = meta_for(seq_lens, [1, 1], tables, 16)
    with pytest.raises(ValueError, match="2 sequences"):
        triton_backend.TritonAttentionBackend().attend(torch.ones(3, 2, 64), torch.ones(2, 1, 2, 16, 2, 64),
                                                       0, meta, 0.1)
