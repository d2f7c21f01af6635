"""Test driver for models and attention backends over a paged KV cache.

Does, in miniature, what the model runner does in production: hands out block ids (in a shuffled
order so block tables are never contiguous), builds the varlen `AttentionMetadata` of a step that
may mix prefill chunks and decodes of several sequences, and runs `model.forward` +
`compute_logits`. No eviction, no prefix sharing: tests give each sequence enough blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_cache import kv_cache_spec_for


def build_metadata(
    block_tables: Sequence[Sequence[int]],
    cached_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and `positions [T]` for sequences adding `query_lens[i]` tokens after `cached_lens[i]`."""
    seq_lens = [c + q for c, q in zip(cached_lens, query_lens, strict=True)]
    positions, slots = [], []
    for table, cached, seq_len in zip(block_tables, cached_lens, seq_lens, strict=True):
        assert len(table) * block_size >= seq_len, "block table too short for the context"
        for pos in range(cached, seq_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


class BlockPool:
    """Block ids in a seeded random order, so neighbouring blocks of a sequence are never adjacent."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self._free = torch.randperm(num_blocks, generator=gen).tolist()

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), "test KV pool exhausted; allocate more blocks"
        taken, self._free = self._free[:n], self._free[n:]
        return taken


class PagedHarness:
    """Runs a model step by step over its own KV cache, tracking each sequence's blocks and length."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, block_size: int = 4,
                 num_blocks: int = 128, dtype: str = "float32") -> None:
        self.model = model
        self.block_size = block_size
        self.spec = kv_cache_spec_for(config.num_layers, config.num_kv_heads, config.head_dim,
                                      config.mla.latent_dim if config.mla else None, block_size, dtype)
        self.kv_cache = self.spec.allocate(num_blocks, "cpu")
        self.pool = BlockPool(num_blocks)
        self.blocks: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """Run one step of `(sequence id, new token ids)` entries; return each one's logits `[q, vocab]`."""
        for seq_id, tokens in chunks:
            self._grow(seq_id, self.cached.get(seq_id, 0) + len(tokens))
        ids = [seq_id for seq_id, _ in chunks]
        meta, positions = build_metadata(
            [self.blocks[s] for s in ids], [self.cached.get(s, 0) for s in ids],
            [len(t) for _, t in chunks], self.block_size,
        )
        input_ids = torch.tensor([tok for _, tokens in chunks for tok in tokens], dtype=torch.int64)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, meta))
        out, start = {}, 0
        for seq_id, tokens in chunks:
            out[seq_id] = logits[start : start + len(tokens)]
            start += len(tokens)
            self.cached[seq_id] = self.cached.get(seq_id, 0) + len(tokens)
        return out

    def _grow(self, seq_id: str, length: int) -> None:
        table = self.blocks.setdefault(seq_id, [])
        needed = -(-length // self.block_size) - len(table)
        if needed > 0:
            table.extend(self.pool.take(needed))
