"""The CUDA-graph decode path's host logic on CPU: capture sizes, padding, persistent buffer filling.

No CUDA here, so the graph itself is stood in for by `ReplayOnBuffers`, which runs the forward pass
on the persistent buffers exactly as a replay reads them (fixed tensors, fixed padded size) and
writes into one fixed output tensor. The model then must give the same logits for the real rows as
the eager varlen path, which pins down that the buffers hold the right ids, positions, slots,
context lengths and block tables, and that padded rows change nothing.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import UNSCALED, AttentionBackend, AttentionMetadata
from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ScheduledChunk
from engine.config import CUDA_GRAPH_BATCH_SIZES, ModelConfig
from engine.cuda_graphs import DecodeGraphRunner, capture_sizes
from engine.input_buffers import DecodeInputBuffers
from engine.kv_cache import KVCacheSpec
from engine.loader.dummy import dummy_weights
from engine.models.llama import LlamaForCausalLM
from engine.sampling_params import SamplingParams

BLOCK = 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def decode_chunk(rid: str, token: int, context_len: int, blocks: tuple[int, ...],
                 sample: bool = True) -> ScheduledChunk:
    """A decode of `token` at position context_len - 1, over `blocks` (may hold spare blocks)."""
    return ScheduledChunk(request_id=rid, token_ids=(token,), start_pos=context_len - 1, block_ids=blocks,
                          needs_sample=sample, sampling=GREEDY, prompt_token_ids=(), output_token_ids=())


# ------------------------------------------------------------------------------------- capture sizes


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, (1,)),
    (64, (1, 2, 4, 8, 16, 24, 32, 48, 64)),
    (100, (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)),
    (20, (1, 2, 4, 8, 16, 24)),
    (500, CUDA_GRAPH_BATCH_SIZES),
])
def test_capture_sizes_stop_at_the_first_size_holding_max_num_seqs(max_num_seqs: int, expected: tuple) -> None:
    assert capture_sizes(CUDA_GRAPH_BATCH_SIZES, max_num_seqs) == expected


def test_padded_size_is_the_smallest_captured_size_that_fits() -> None:
    graphs = DecodeGraphRunner(lambda *a: torch.empty(0), DecodeInputBuffers(16, 4, BLOCK, CPU), (1, 2, 4, 8, 16), 64)
    assert [graphs.padded_size(b) for b in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="outside"):
        graphs.padded_size(17)


def test_only_small_enough_decode_only_steps_take_the_graph() -> None:
    graphs = DecodeGraphRunner(lambda *a: torch.empty(0), DecodeInputBuffers(4, 4, BLOCK, CPU), (1, 2, 4), 64)
    decodes = [decode_chunk(str(i), 1, 3, (i,)) for i in range(5)]
    prefill = ScheduledChunk("p", (1, 2), 0, (9,), True, GREEDY, (), ())
    assert graphs.can_run(decodes[:4])
    assert not graphs.can_run(decodes)  # 5 > largest captured size: eager
    assert not graphs.can_run(decodes[:2] + [prefill])  # mixed step: eager
    assert not graphs.can_run([])


# ------------------------------------------------------------------------------------- buffer filling


def test_load_writes_rows_and_pads_the_rest() -> None:
    buffers = DecodeInputBuffers(max_batch=8, max_blocks=6, block_size=BLOCK, device=CPU)
    chunks = [decode_chunk("a", 11, 6, (7, 3, 9)), decode_chunk("b", 12, 1, (5,)), decode_chunk("c", 13, 9, (2, 8, 4))]
    buffers.load(chunks, padded=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 0, 8, 0]
    # slot = block_ids[pos // 4] * 4 + pos % 4; padded rows get -1 (the KV store skips them)
    assert buffers.slot_mapping[:4].tolist() == [3 * 4 + 1, 5 * 4 + 0, 4 * 4 + 0, -1]
    assert buffers.seq_lens[:4].tolist() == [6, 1, 9, 0]
    # width = 3 blocks (c's 9 tokens); only the blocks a context covers, spare blocks not copied
    assert buffers.block_tables[:4, :3].tolist() == [[7, 3, 0], [5, 0, 0], [2, 8, 4], [0, 0, 0]]


def test_shrinking_batch_turns_old_rows_into_padding() -> None:
    buffers = DecodeInputBuffers(max_batch=8, max_blocks=6, block_size=BLOCK, device=CPU)
    buffers.load([decode_chunk(str(i), 100 + i, 5, (i, 10 + i)) for i in range(6)], padded=8)
    buffers.load([decode_chunk("x", 7, 2, (30,)), decode_chunk("y", 8, 3, (31,))], padded=4)
    assert buffers.input_ids[:4].tolist() == [7, 8, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [30 * 4 + 1, 31 * 4 + 2, -1, -1]
    assert buffers.seq_lens[:4].tolist() == [2, 3, 0, 0]
    assert buffers.block_tables[:4, :1].tolist() == [[30], [31], [0], [0]]


def test_clear_makes_every_row_a_no_op() -> None:
    buffers = DecodeInputBuffers(max_batch=4, max_blocks=2, block_size=BLOCK, device=CPU)
    buffers.load([decode_chunk("a", 5, 3, (1,))], padded=4)
    buffers.clear(4)
    assert buffers.slot_mapping.tolist() == [-1] * 4
    assert buffers.seq_lens.tolist() == [0] * 4
    assert buffers.input_ids.tolist() == [0] * 4


def test_metadata_views_the_persistent_buffers() -> None:
    buffers = DecodeInputBuffers(max_batch=8, max_blocks=4, block_size=BLOCK, device=CPU)
    meta = buffers.metadata(4, max_seq_len=16)
    assert meta.is_decode_only and meta.num_seqs == 4
    assert meta.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()
    assert meta.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    assert tuple(meta.block_tables.shape) == (4, 4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("chunks", "padded", "message"), [
    ([ScheduledChunk("p", (1, 2), 0, (1,), True, GREEDY, (), ())], 1, "1 token per sequence"),
    ([decode_chunk("a", 1, 9, (1, 2))], 1, "cannot hold"),
    ([decode_chunk("a", 1, 3, (1,))] * 3, 2, "padded"),
    ([decode_chunk("a", 1, 3, (1,))], 9, "max_batch"),
    ([decode_chunk("a", 1, 4 * 5, (1, 2, 3, 4, 5))], 1, "5 blocks"),
])
def test_load_rejects_what_a_graph_cannot_run(chunks: list, padded: int, message: str) -> None:
    buffers = DecodeInputBuffers(max_batch=8, max_blocks=4, block_size=BLOCK, device=CPU)
    with pytest.raises(ValueError, match=message):
        buffers.load(chunks, padded)


# ----------------------------------------------------------------- buffers through the model, on CPU


class PaddingAwareBackend(AttentionBackend):
    """The torch reference plus the Triton kernels' padding contract: slot < 0 is not stored, and a
    row with no context attends to nothing (zeros)."""

    name = "torch"

    def __init__(self) -> None:
        self.ref = TorchAttentionBackend()

    def write_kv(self, kv_cache, layer, key, value, slot_mapping, kv_scale=UNSCALED) -> None:  # type: ignore[no-untyped-def]
        keep = slot_mapping >= 0
        self.ref.write_kv(kv_cache, layer, key[keep], value[keep], slot_mapping[keep], kv_scale)

    def attend(self, query, kv_cache, layer, meta: AttentionMetadata, scale: float,  # type: ignore[no-untyped-def]
               kv_scale=UNSCALED) -> torch.Tensor:
        empty = meta.seq_lens == 0
        clamped = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens.clamp_min(1),
                                    meta.block_tables, meta.max_query_len, meta.max_seq_len,
                                    meta.query_lens_cpu, meta.seq_lens_cpu)
        return self.ref.attend(query, kv_cache, layer, clamped, scale, kv_scale).masked_fill(empty[:, None, None], 0.0)


class ReplayOnBuffers:
    """Stands in for a captured graph: same inputs (the buffers), same output tensor every replay."""

    def __init__(self, forward, buffers: DecodeInputBuffers, size: int, max_seq_len: int) -> None:  # type: ignore[no-untyped-def]
        self.args = (buffers.input_ids[:size], buffers.positions[:size], buffers.metadata(size, max_seq_len))
        self.forward = forward
        self.out = forward(*self.args).clone()

    def replay(self) -> None:
        self.out.copy_(self.forward(*self.args))


TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


def test_replayed_padded_decode_matches_eager_decode() -> None:
    model = LlamaForCausalLM(TINY, PaddingAwareBackend())
    model.load_weights(dummy_weights(TINY, torch.float32, seed=3))
    spec = KVCacheSpec(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, BLOCK, "float32")
    kv_cache = torch.randn((40, *spec.block_shape), generator=torch.Generator().manual_seed(0))
    eager_cache = kv_cache.clone()
    forward = lambda ids, pos, meta: model.compute_logits(model(ids, pos, kv_cache, meta))  # noqa: E731
    buffers = DecodeInputBuffers(max_batch=8, max_blocks=16, block_size=BLOCK, device=CPU)
    graphs = DecodeGraphRunner(forward, buffers, (2, 8), capture_max_seq_len=64)
    with torch.inference_mode():
        for size in graphs.sizes:
            buffers.clear(size)
            fake = ReplayOnBuffers(forward, buffers, size, 64)
            graphs._graphs[size] = (fake, fake.out)  # type: ignore[assignment]
        chunks = [decode_chunk("a", 5, 7, (3, 17, 30)), decode_chunk("b", 9, 13, (1, 2, 8, 22)),
                  decode_chunk("c", 1, 1, (39,))]
        logits = graphs.run(chunks)  # 3 rows padded to 8
        expected = eager_decode(model, eager_cache, chunks)
    assert logits.shape == (3, TINY.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_cache, eager_cache, rtol=1e-6, atol=1e-6)  # padded rows stored nothing


def eager_decode(model: LlamaForCausalLM, kv_cache: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """The same step as an unpadded varlen batch, metadata built by hand."""
    bs = BLOCK
    width = max(-(-c.context_len // bs) for c in chunks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([c.block_ids[c.start_pos // bs] * bs + c.start_pos % bs for c in chunks]),
        query_start_loc=torch.arange(len(chunks) + 1, dtype=torch.int32),
        seq_lens=torch.tensor([c.context_len for c in chunks], dtype=torch.int32),
        block_tables=torch.tensor([list(c.block_ids[:width]) + [0] * (width - len(c.block_ids[:width]))
                                   for c in chunks], dtype=torch.int32),
        max_query_len=1, max_seq_len=max(c.context_len for c in chunks),
        query_lens_cpu=(1,) * len(chunks), seq_lens_cpu=tuple(c.context_len for c in chunks))
    ids = torch.tensor([c.token_ids[0] for c in chunks])
    pos = torch.tensor([c.start_pos for c in chunks])
    return model.compute_logits(model(ids, pos, kv_cache, meta))
