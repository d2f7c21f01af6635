"""The torch attention backend against dense causal attention on contiguous K/V, computed in float64."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_harness import BlockPool, build_metadata

from engine.attention.torch_ref import TorchAttentionBackend
from engine.kv_cache import KVCacheSpec

HEAD_DIM = 16
NUM_KV_HEADS = 2
NUM_LAYERS = 3
LAYER = 1  # a middle layer, so a layer-indexing mistake shows up
NUM_BLOCKS = 160


@dataclass
class Case:
    query: torch.Tensor  # [T, H_q, D]
    out: torch.Tensor  # [T, H_q, D] from the backend
    keys: list[torch.Tensor]  # per sequence, [S, H_kv, D] contiguous
    values: list[torch.Tensor]
    query_lens: list[int]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention: q [q, H_q, D] are the last q positions of k/v [S, H_kv, D]; float64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + (seq_len - q_len)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_case(seqs: list[tuple[int, int]], group: int, block_size: int,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """Each seq is (cached_len, query_len): the cached prefix is written in an earlier "step"."""
    gen = torch.Generator().manual_seed(seed)
    backend = TorchAttentionBackend()
    spec = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, block_size, str(dtype).removeprefix("torch."))
    cache = spec.allocate(NUM_BLOCKS, "cpu")
    pool = BlockPool(NUM_BLOCKS, seed)
    tables = [pool.take(-(-(c + q) // block_size)) for c, q in seqs]
    cached, query_lens = [c for c, _ in seqs], [q for _, q in seqs]
    keys = [torch.randn(c + q, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for c, q in seqs]
    values = [torch.randn(c + q, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for c, q in seqs]
    prefix_meta, _ = build_metadata(tables, [0] * len(seqs), cached, block_size)
    prefix_k = torch.cat([k[:c] for k, c in zip(keys, cached, strict=True)])
    prefix_v = torch.cat([v[:c] for v, c in zip(values, cached, strict=True)])
    backend.write_kv(cache, LAYER, prefix_k, prefix_v, prefix_meta.slot_mapping)
    meta, _ = build_metadata(tables, cached, query_lens, block_size)
    new_k = torch.cat([k[c:] for k, c in zip(keys, cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, cached, strict=True)])
    backend.write_kv(cache, LAYER, new_k, new_v, meta.slot_mapping)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    out = backend.attend(query, cache, LAYER, meta, HEAD_DIM**-0.5)
    return Case(query, out, keys, values, query_lens)


def max_error(case: Case) -> float:
    err, start = 0.0, 0
    for k, v, q_len in zip(case.keys, case.values, case.query_lens, strict=True):
        rows = slice(start, start + q_len)
        expected = reference(case.query[rows], k, v, HEAD_DIM**-0.5)
        err = max(err, (case.out[rows].double() - expected).abs().max().item())
        start += q_len
    return err


SHAPES = pytest.mark.parametrize("group", [1, 3, 4])
BLOCKS = pytest.mark.parametrize("block_size", [1, 4, 16])


@SHAPES
@BLOCKS
def test_prefill_varlen(group: int, block_size: int) -> None:
    assert max_error(run_case([(0, 7), (0, 19), (0, 2)], group, block_size)) < 1e-5


@SHAPES
@BLOCKS
def test_chunked_prefill_over_cached_prefix(group: int, block_size: int) -> None:
    assert max_error(run_case([(10, 6), (16, 16), (3, 21)], group, block_size)) < 1e-5


@SHAPES
@BLOCKS
def test_decode_batch(group: int, block_size: int) -> None:
    assert max_error(run_case([(0, 1), (5, 1), (16, 1), (33, 1)], group, block_size)) < 1e-5


@SHAPES
@BLOCKS
def test_mixed_prefill_chunks_and_decodes(group: int, block_size: int) -> None:
    assert max_error(run_case([(0, 9), (12, 1), (5, 7), (30, 1), (0, 1)], group, block_size)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_close_to_float64(dtype: torch.dtype) -> None:
    case = run_case([(0, 12), (20, 1), (7, 5), (40, 1)], group=4, block_size=4, dtype=dtype)
    assert max_error(case) < 2e-2


def test_decode_ignores_stale_values_in_padding_slots() -> None:
    # Slots past seq_len (a freed block's old contents) must get zero weight, however large they are.
    block_size, cache_spec = 4, KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, 4, "float32")
    cache = cache_spec.allocate(8, "cpu").fill_(1e4)
    keys, values = torch.randn(6, NUM_KV_HEADS, HEAD_DIM), torch.randn(6, NUM_KV_HEADS, HEAD_DIM)
    backend = TorchAttentionBackend()
    meta, _ = build_metadata([[5, 2]], [0], [6], block_size)
    backend.write_kv(cache, LAYER, keys, values, meta.slot_mapping)
    decode_meta, _ = build_metadata([[5, 2], [3]], [5, 0], [1, 1], block_size)  # longest context wins padding
    query = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    out = backend.attend(query, cache, LAYER, decode_meta, 0.25)
    expected = reference(query[:1], keys, values, 0.25)
    assert (out[0].double() - expected[0]).abs().max().item() < 1e-5


def test_write_kv_fills_only_its_layer_and_slots() -> None:
    cache = KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, 4, "float32").allocate(6, "cpu")
    key, value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM), torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1])  # block 5 offset 3, block 2 offsets 0-1
    TorchAttentionBackend().write_kv(cache, LAYER, key, value, slots)
    assert torch.equal(cache[5, LAYER, 0, 3], key[0])
    assert torch.equal(cache[2, LAYER, 1, :2], value[1:])
    assert int((cache != 0).sum()) == 2 * 3 * NUM_KV_HEADS * HEAD_DIM
