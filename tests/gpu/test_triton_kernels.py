"""The compiled Triton attention kernels on a CUDA GPU at Llama-3.1-8B shapes, against fp32 references.

Shapes: 32 query heads, 8 KV heads, head_dim 128, block size 16, batches up to 64, contexts up to 8k,
random non-contiguous block tables, fresh random bf16 inputs per test, NaN-poisoned outputs.
Pass mark: ||out - ref|| / ||ref|| <= 1e-2 per sequence, against attention computed in float32 from
the same (bf16) cache contents. Every launch config the attention sweep may choose
(engine/kernels/attention_tiles.py candidates) is run here against the same reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.required import require_module

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
require_module("triton")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.attention_tiles import (  # noqa: E402
    DECODE_CANDIDATES,
    PREFILL_CANDIDATES,
    PREFILL_TABLE,
    WARP_SPECIALIZED_CANDIDATES,
    DecodeConfig,
    DecodeRows,
    PrefillConfig,
    PrefillRows,
)
from engine.kernels.kv_store import is_interpreted, store_kv  # noqa: E402
from engine.kernels.paged_decode import _decode_split_kernel, choose_num_splits, paged_decode  # noqa: E402
from engine.kernels.paged_mixed import paged_mixed  # noqa: E402
from engine.kernels.paged_prefill import paged_prefill  # noqa: E402

H_Q, H_KV, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS, LAYER = 2, 1  # attend to layer 1 so the layer offset into each block is exercised
SCALE = 1.0 / math.sqrt(HEAD_DIM)
MAX_REL_ERR = 1e-2
DEVICE = torch.device("cuda")


def test_kernels_are_compiled_not_interpreted() -> None:
    """TRITON_INTERPRET leaking into this process would test the interpreter instead of the GPU code."""
    assert not is_interpreted(_decode_split_kernel)


# ----------------------------------------------------------------------------------------------- helpers


def make_cache(num_blocks: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    shape = (num_blocks, LAYERS, 2, BLOCK, H_KV, HEAD_DIM)
    return torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)


def random_block_tables(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct shuffled block ids per sequence (pad entries 0), [B, max_blocks + 3] int32."""
    need = [math.ceil(n / BLOCK) for n in seq_lens]
    assert sum(need) <= num_blocks
    ids = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(need) + 3), dtype=torch.int32, device=DEVICE)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[start:start + n]
        start += n
    return table


def random_lens(batch: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    return torch.randint(low, high + 1, (batch,), generator=gen, device=DEVICE).tolist()


def reference(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
              query_lens: list[int]) -> list[torch.Tensor]:
    """Per sequence, fp32 causal attention from the cache contents: [q_len, H_q, D] each."""
    group = H_Q // H_KV
    outs, row = [], 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(seq_len, device=DEVICE)
        blocks = block_tables[i].long()[pos // BLOCK]
        k = cache[blocks, LAYER, 0, pos % BLOCK].float()  # [S, H_kv, D]
        v = cache[blocks, LAYER, 1, pos % BLOCK].float()
        q = query[row:row + q_len].float().view(q_len, H_KV, group, HEAD_DIM)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * SCALE
        q_pos = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        scores = scores.masked_fill(pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
        out = torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), v)
        outs.append(out.reshape(q_len, H_Q, HEAD_DIM))
        row += q_len
    return outs


def assert_close(out: torch.Tensor, refs: list[torch.Tensor], query_lens: list[int]) -> None:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN output elements"
    row = 0
    for i, (ref, q_len) in enumerate(zip(refs, query_lens, strict=True)):
        err = ((out[row:row + q_len].float() - ref).norm() / ref.norm()).item()
        assert err <= MAX_REL_ERR, f"sequence {i}: relative error {err:.2e}"
        row += q_len


def metadata(seq_lens: list[int], query_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    slots = []
    table = block_tables.tolist()
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        slots += [table[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len - q_len, seq_len)]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


# --------------------------------------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_store_kv_scatters_rows_and_skips_negative_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    cache = make_cache(2048, dtype, gen)
    expected = cache.clone()
    num_tokens = 4096
    slots = torch.randperm(2048 * BLOCK - 1, generator=gen, device=DEVICE)[:num_tokens] + 1
    slots[torch.randperm(num_tokens, generator=gen, device=DEVICE)[:100]] = -1
    qkv = torch.randn(num_tokens, (H_Q + 2 * H_KV) * HEAD_DIM, generator=gen, device=DEVICE).to(dtype)
    key = qkv[:, H_Q * HEAD_DIM:(H_Q + H_KV) * HEAD_DIM].view(num_tokens, H_KV, HEAD_DIM)  # strided views
    value = qkv[:, (H_Q + H_KV) * HEAD_DIM:].view(num_tokens, H_KV, HEAD_DIM)
    store_kv(cache, LAYER, key, value, slots)
    keep = slots >= 0
    blocks, offsets = slots[keep] // BLOCK, slots[keep] % BLOCK
    expected[blocks, LAYER, 0, offsets] = key[keep]
    expected[blocks, LAYER, 1, offsets] = value[keep]
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


# -------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    ("batch", "min_ctx", "max_ctx", "num_splits"),
    [(1, 8192, 8192, None), (8, 1, 4096, None), (64, 3000, 4096, 1), (64, 1, 8192, None), (5, 6000, 8192, 7),
     (64, 1, 8192, 32)],
)
def test_paged_decode_matches_fp32_reference(batch: int, min_ctx: int, max_ctx: int,
                                             num_splits: int | None) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 7919 + max_ctx + (num_splits or 0))
    seq_lens = random_lens(batch, min_ctx, max_ctx, gen)
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 64
    cache = make_cache(num_blocks, torch.bfloat16, gen)
    tables = random_block_tables(seq_lens, num_blocks, gen)
    query = torch.randn(batch, H_Q, HEAD_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    if num_splits is None:  # what the backend would pick on this card
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        num_splits = choose_num_splits(batch, H_KV, sms, max(seq_lens))
    paged_decode(query, cache, LAYER, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                 SCALE, num_splits, out=out)
    assert_close(out, reference(query, cache, tables, seq_lens, [1] * batch), [1] * batch)


@pytest.mark.parametrize("config", DECODE_CANDIDATES, ids=DecodeConfig.label)
def test_every_decode_candidate_config_matches_fp32_reference(config: DecodeConfig) -> None:
    """Each config the sweep may pick, with the split count it gives a batch of 8 on this card."""
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    seq_lens = random_lens(8, 1, 8192, gen)
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 64
    cache = make_cache(num_blocks, torch.bfloat16, gen)
    tables = random_block_tables(seq_lens, num_blocks, gen)
    query = torch.randn(8, H_Q, HEAD_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    splits = config.num_splits(8, H_KV, sms, max(seq_lens))
    paged_decode(query, cache, LAYER, tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), SCALE,
                 splits, out=out, block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages)
    assert_close(out, reference(query, cache, tables, seq_lens, [1] * 8), [1] * 8)


def test_paged_decode_replays_in_a_cuda_graph_as_contexts_change() -> None:
    """A captured decode (fixed splits) stays correct when the metadata buffers change in place."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    batch, num_blocks = 16, 16 * 512 + 64
    cache = make_cache(num_blocks, torch.bfloat16, gen)
    query = torch.empty(batch, H_Q, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
    seq_lens_buf = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    tables_buf = torch.zeros(batch, 512 + 3, dtype=torch.int32, device=DEVICE)
    backend = TritonAttentionBackend(decode_num_splits=4)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE), query_start_loc=torch.arange(
            batch + 1, dtype=torch.int32, device=DEVICE), seq_lens=seq_lens_buf, block_tables=tables_buf,
        max_query_len=1, max_seq_len=8192, query_lens_cpu=(1,) * batch, seq_lens_cpu=(8192,) * batch,
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.attend(query, cache, LAYER, meta, SCALE)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend(query, cache, LAYER, meta, SCALE)
    for max_ctx in (100, 8192):
        seq_lens = random_lens(batch, 1, max_ctx, gen)
        tables = random_block_tables(seq_lens, num_blocks, gen)
        query.copy_(torch.randn(query.shape, generator=gen, device=DEVICE))
        seq_lens_buf.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        tables_buf.zero_()
        tables_buf[:, :tables.shape[1]].copy_(tables)
        out.fill_(float("nan"))
        graph.replay()
        assert_close(out, reference(query, cache, tables, seq_lens, [1] * batch), [1] * batch)


# ------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    ("seq_lens", "query_lens"),
    [
        ([2048, 1500, 777, 64], [2048, 1500, 777, 64]),  # fresh prompts
        ([4096, 8192, 5000], [512, 1024, 333]),  # chunks extending cached prefixes
        ([8000] * 24 + [3000, 4100] + [700] * 24, [1] * 24 + [2048, 100] + [1] * 24),  # mixed with decodes
    ],
    ids=["prompts", "extend", "mixed"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_prefill_matches_fp32_reference(seq_lens: list[int], query_lens: list[int],
                                              dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(sum(query_lens) + len(seq_lens))
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 64
    cache = make_cache(num_blocks, dtype, gen)
    tables = random_block_tables(seq_lens, num_blocks, gen)
    meta = metadata(seq_lens, query_lens, tables)
    query = torch.randn(sum(query_lens), H_Q, HEAD_DIM, generator=gen, device=DEVICE).to(dtype)
    out = torch.full_like(query, float("nan"))
    paged_prefill(query, cache, LAYER, tables, meta.seq_lens, meta.query_start_loc, SCALE, out=out)
    assert_close(out, reference(query, cache, tables, seq_lens, query_lens), query_lens)


MIXED_SEQ_LENS = [3072, 3072] + [2048] * 30 + [5000, 1]
MIXED_QUERY_LENS = [1024, 700] + [1] * 30 + [333, 1]


@pytest.mark.parametrize(
    ("config", "decode_rows"),
    [*((c, DecodeRows.INLINE) for c in (*PREFILL_CANDIDATES, *WARP_SPECIALIZED_CANDIDATES)),
     *((PREFILL_TABLE[PrefillRows.LARGE], mode) for mode in DecodeRows)],
    ids=lambda v: v.label() if isinstance(v, PrefillConfig) else v.value,
)
def test_every_prefill_candidate_config_matches_fp32_reference(config: PrefillConfig,
                                                               decode_rows: DecodeRows) -> None:
    """A mixed batch (prompt chunks, an extend, decode rows, a one-token prompt) through each config the
    sweep may pick, and through the default config with the decode rows in each place they can run."""
    if config.warp_specialize and torch.cuda.get_device_capability(DEVICE)[0] < 10:
        pytest.skip("needs a CUDA GPU of capability 10 (Blackwell): Triton documents automatic warp specialization "
                    "there only")
    gen = torch.Generator(device=DEVICE).manual_seed(23)
    num_blocks = sum(math.ceil(n / BLOCK) for n in MIXED_SEQ_LENS) + 64
    cache = make_cache(num_blocks, torch.bfloat16, gen)
    tables = random_block_tables(MIXED_SEQ_LENS, num_blocks, gen)
    meta = metadata(MIXED_SEQ_LENS, MIXED_QUERY_LENS, tables)
    query = torch.randn(sum(MIXED_QUERY_LENS), H_Q, HEAD_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    args = (query, cache, LAYER, tables, meta.seq_lens, meta.query_start_loc, SCALE)
    if decode_rows == DecodeRows.DECODE_KERNEL:
        sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
        paged_mixed(*args, MIXED_QUERY_LENS.count(1), sms, max(MIXED_SEQ_LENS), out=out, prefill=config)
    else:
        paged_prefill(*args, out=out, config=config, decode_rows=decode_rows)
    assert_close(out, reference(query, cache, tables, MIXED_SEQ_LENS, MIXED_QUERY_LENS), MIXED_QUERY_LENS)


# ------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("query_lens", [[1] * 32, [1] * 30 + [300, 17]], ids=["decode_only", "mixed"])
def test_triton_backend_agrees_with_torch_backend_on_cuda(query_lens: list[int]) -> None:
    """write_kv + attend through both backends' interface: same cache bytes, outputs within 1e-2."""
    gen = torch.Generator(device=DEVICE).manual_seed(len(query_lens) + sum(query_lens))
    seq_lens = [q + c for q, c in zip(query_lens, random_lens(len(query_lens), 0, 3000, gen), strict=True)]
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 64
    cache = make_cache(num_blocks, torch.bfloat16, gen)
    tables = random_block_tables(seq_lens, num_blocks, gen)
    meta = metadata(seq_lens, query_lens, tables)
    num_tokens = sum(query_lens)
    key, value = torch.randn(2, num_tokens, H_KV, HEAD_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    query = torch.randn(num_tokens, H_Q, HEAD_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    results = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        kv = cache.clone()
        backend.write_kv(kv, LAYER, key, value, meta.slot_mapping)
        results.append((kv, backend.attend(query, kv, LAYER, meta, SCALE)))
    (kv_triton, out_triton), (kv_torch, out_torch) = results
    assert torch.equal(kv_triton, kv_torch)
    assert_close(out_triton, reference(query, kv_triton, tables, seq_lens, query_lens), query_lens)
    err = ((out_triton.float() - out_torch.float()).norm() / out_torch.float().norm()).item()
    assert err <= MAX_REL_ERR
