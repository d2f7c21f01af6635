"""Mixed steps (decode rows inline, in prefill tiles, or in the decode kernel) and every candidate
launch config of the sweep, under triton's CPU interpreter against a float64 reference.

The interpreter ignores num_warps / num_stages, so the candidates are checked for what it can see: the
tile shapes (a different BLOCK_M / BLOCK_N changes which tiles are diagonal, partial or skipped) and
the warp-specialize flag's loop. On a GPU tests/gpu/test_triton_kernels.py runs every candidate
compiled.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support.triton_interpret import import_interpreted, interpreted

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

paged_decode_mod, paged_prefill_mod, paged_mixed_mod = import_interpreted(
    "engine.kernels.paged_decode", "engine.kernels.paged_prefill", "engine.kernels.paged_mixed")

from engine.kernels.attention_tiles import (  # noqa: E402
    DECODE_CANDIDATES,
    DECODE_TABLE,
    PREFILL_CANDIDATES,
    WARP_SPECIALIZED_CANDIDATES,
    DecodeConfig,
    DecodeRows,
    PrefillConfig,
)
from tests.support.paged_reference import (  # noqa: E402
    make_cache,
    meta_for,
    poisoned_like,
    random_block_tables,
    reference,
    rel_err,
)

BLOCK, H_KV, GROUP, HEAD_DIM = 16, 2, 4, 32
# Decode rows (q_len 1) around two prompt chunks, one over a cached prefix; one decode row at a page edge.
SEQ_LENS, QUERY_LENS = [70, 40, 33, 50, 17, 48], [1, 40, 1, 20, 1, 1]
SCALE = 0.125


@pytest.fixture(autouse=True, scope="module")
def _interpret_mode() -> Iterator[None]:
    with interpreted():
        yield


def mixed_inputs(seed: int, dtype: torch.dtype = torch.float32) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(40, 2, BLOCK, H_KV, HEAD_DIM, dtype, gen)
    tables = random_block_tables(SEQ_LENS, BLOCK, 40, gen)
    meta = meta_for(SEQ_LENS, QUERY_LENS, tables, BLOCK)
    query = torch.randn(sum(QUERY_LENS), H_KV * GROUP, HEAD_DIM, generator=gen).to(dtype)
    ref = reference(query, cache, 1, tables, SEQ_LENS, QUERY_LENS, SCALE)
    return cache, tables, meta, query, ref


def decode_row_mask() -> torch.Tensor:
    """True for the query rows of single-row (decode) sequences."""
    return torch.tensor([q_len == 1 for q_len in QUERY_LENS for _ in range(q_len)])


@pytest.mark.parametrize(("dtype", "programs_per_sm"), [(torch.float32, 1), (torch.bfloat16, 64)],
                         ids=["fp32_one_split", "bf16_many_splits"])
def test_mixed_step_matches_reference(dtype: torch.dtype, programs_per_sm: int) -> None:
    cache, tables, meta, query, ref = mixed_inputs(1, dtype)
    out = poisoned_like(query)
    decode = DecodeConfig(16, 4, 2, programs_per_sm=programs_per_sm, min_split_tokens=16)
    paged_mixed_mod.paged_mixed(query, cache, 1, tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                num_decode_rows=4, num_sms=2, max_seq_len=70, out=out,
                                prefill=PrefillConfig(16, 16, 4, 2), decode=decode)
    assert not out.isnan().any()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("mode", [DecodeRows.INLINE, DecodeRows.PREFILL_TILES], ids=lambda m: m.value)
def test_one_prefill_launch_attends_the_decode_rows_too(mode: DecodeRows) -> None:
    cache, tables, meta, query, ref = mixed_inputs(8)
    out = poisoned_like(query)
    paged_prefill_mod.paged_prefill(query, cache, 1, tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                    out=out, config=PrefillConfig(32, 16, 4, 2), decode_rows=mode)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


def test_prefill_skipping_decode_rows_writes_only_the_other_rows() -> None:
    cache, tables, meta, query, ref = mixed_inputs(2)
    out = poisoned_like(query)
    paged_prefill_mod.paged_prefill(query, cache, 1, tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                    out=out, config=PrefillConfig(16, 16, 4, 2),
                                    decode_rows=DecodeRows.DECODE_KERNEL)
    decode_rows = decode_row_mask()
    assert out[decode_rows].isnan().all()
    assert rel_err(out[~decode_rows], ref[~decode_rows]) < 1e-5


@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen_decode_writes_only_the_decode_rows(num_splits: int) -> None:
    cache, tables, meta, query, ref = mixed_inputs(3)
    out = poisoned_like(query)
    paged_decode_mod.paged_decode(query, cache, 1, tables, meta.seq_lens, SCALE, num_splits, out=out,
                                  block_n=16, query_start_loc=meta.query_start_loc)
    decode_rows = decode_row_mask()
    assert out[~decode_rows].isnan().all()
    assert rel_err(out[decode_rows], ref[decode_rows]) < 1e-5


def test_varlen_decode_rejects_query_start_loc_of_the_wrong_length() -> None:
    cache, tables, meta, query, _ = mixed_inputs(4)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_mod.paged_decode(query, cache, 1, tables, meta.seq_lens, SCALE, 1,
                                      query_start_loc=meta.query_start_loc[:-1].contiguous())


def test_mixed_warm_up_compiles_each_default_decode_config_and_leaves_the_cache_alone() -> None:
    cache, *_ = mixed_inputs(5)
    before = cache.clone()
    assert paged_mixed_mod.warm_up(cache, H_KV * GROUP, torch.float32) == 2 * len(set(DECODE_TABLE.values()))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("block_n", sorted({c.block_n for c in DECODE_CANDIDATES}))
def test_every_decode_candidate_tile_matches_reference(block_n: int) -> None:
    cache, tables, meta, query, ref = mixed_inputs(6)
    rows = decode_row_mask()
    decode_query = query[rows].contiguous()
    decode_lens = [s for s, q in zip(SEQ_LENS, QUERY_LENS, strict=True) if q == 1]
    decode_tables = tables[torch.tensor([q == 1 for q in QUERY_LENS])].contiguous()
    out = poisoned_like(decode_query)
    paged_decode_mod.paged_decode(decode_query, cache, 1, decode_tables, torch.tensor(decode_lens, dtype=torch.int32),
                                  SCALE, 2, out=out, block_n=block_n)
    assert rel_err(out, ref[rows]) < 1e-5


@pytest.mark.parametrize(
    "config",
    sorted({PrefillConfig(c.block_m, c.block_n, 4, 2, c.warp_specialize)
            for c in (*PREFILL_CANDIDATES, *WARP_SPECIALIZED_CANDIDATES)}, key=PrefillConfig.label),
    ids=PrefillConfig.label,
)
def test_every_prefill_candidate_tile_matches_reference(config: PrefillConfig) -> None:
    cache, tables, meta, query, ref = mixed_inputs(7)
    out = poisoned_like(query)
    paged_mixed_mod.paged_mixed(query, cache, 1, tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                num_decode_rows=4, num_sms=2, max_seq_len=70, out=out, prefill=config)
    assert rel_err(out, ref) < 1e-5
