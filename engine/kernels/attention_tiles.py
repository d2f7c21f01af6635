"""Launch configurations of the paged attention kernels, chosen on the host by shape class.

The decode and prefill kernels are correct under every configuration here; only speed depends on
the choice. The tables below hold the defaults, one line per shape class, picked from
`python -m lab.micro.attention_sweep` (which times every candidate in
`DECODE_CANDIDATES` / `PREFILL_CANDIDATES` per case and prints the line to paste).

Decode: a program streams `num_splits` of one sequence's context for one KV head. Bandwidth comes
from many programs with loads in flight at once, so split-KV targets `programs_per_sm` programs per
multiprocessor (not one wave): a batch of 8 at 8k has 64 (sequence, KV head) pairs, too few to
keep the memory system busy on a 132-SM card unless each is split. Splits stop at `min_split_tokens`
per split, below which a split's fixed cost (query load, partial write, merge) dominates.

CUDA graphs: the config is a function of (batch, max_seq_len) read on the host. A captured decode
graph freezes the config of its capture step (capture passes the model's context window as
`max_seq_len`); any config is correct for any context, so replay stays correct as contexts grow.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # context tokens per tile
    num_warps: int
    num_stages: int  # software-pipelining depth of the tile loop
    programs_per_sm: int  # split-KV target: grid programs per multiprocessor
    min_split_tokens: int  # fewest tokens a split may get

    def num_splits(self, batch: int, num_kv_heads: int, num_sms: int, max_seq_len: int | None) -> int:
        """Splits per (sequence, KV head); without `max_seq_len` a function of the batch alone."""
        work = max(1, batch * num_kv_heads)
        splits = min(MAX_SPLITS, max(1, math.ceil(self.programs_per_sm * num_sms / work)))
        if max_seq_len is not None:
            splits = min(splits, max(1, math.ceil(max_seq_len / self.min_split_tokens)))
        return splits

    def label(self) -> str:
        return (f"n{self.block_n} w{self.num_warps} s{self.num_stages} "
                f"pps{self.programs_per_sm} min{self.min_split_tokens}")


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows (tokens x GQA group) per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # Triton's automatic warp specialization of the off-diagonal loop

    def label(self) -> str:
        return (f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages}"
                + (" ws" if self.warp_specialize else ""))


class DecodeBatch(enum.Enum):
    """How the batch's (sequence, KV head) pairs compare with the card's multiprocessors."""

    FEW = "few"  # pairs <= SMs / 2: split-KV carries all the parallelism (batch 1-8 at 8 KV heads)
    SOME = "some"  # pairs <= 2 x SMs: a few splits still help (batch ~32)
    MANY = "many"  # the batch alone fills the card (batch 64+)


class ContextLength(enum.Enum):
    SHORT = "short"  # max_seq_len <= 2048
    LONG = "long"


class DecodeRows(enum.Enum):
    """Where the decode rows (single-token queries) of a mixed prefill + decode step are attended."""

    PREFILL_TILES = "prefill_tiles"  # as any prefill row: each pads a whole BLOCK_M-row tile (pre-sweep)
    INLINE = "inline"  # in the prefill launch, with a decode tile (the GQA group padded to 16 rows)
    DECODE_KERNEL = "decode_kernel"  # skipped by the prefill kernel; a second launch, with split-KV


class PrefillRows(enum.Enum):
    SMALL = "small"  # fewer than LARGE_BATCH_ROWS query rows: decode-heavy mixes, short chunks
    LARGE = "large"  # long prompts: matrix-bound, large tiles pay off


LARGE_BATCH_ROWS = 4096  # query rows (tokens x GQA group) from which the large tiles pay off
LONG_CONTEXT = 2048

# Today's (pre-sweep) behaviour, kept as the first sweep candidate so every run measures it.
DECODE_BASELINE = DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=2, min_split_tokens=256)
PREFILL_BASELINE = {PrefillRows.SMALL: PrefillConfig(64, 64, 4, 2), PrefillRows.LARGE: PrefillConfig(128, 64, 8, 2)}

# ---- defaults: edit one line per shape class from the sweep's "table line" output --------------------
DECODE_TABLE: dict[tuple[DecodeBatch, ContextLength], DecodeConfig] = {
    # `lab.micro.attention_sweep` on one H200, 2026-12-02 (graph-replayed; docs/benchmarks.md)
    (DecodeBatch.FEW, ContextLength.SHORT): DecodeConfig(64, 4, 3, programs_per_sm=16, min_split_tokens=128),
    (DecodeBatch.FEW, ContextLength.LONG): DecodeConfig(64, 4, 3, programs_per_sm=8, min_split_tokens=128),
    (DecodeBatch.SOME, ContextLength.SHORT): DecodeConfig(64, 4, 2, programs_per_sm=2, min_split_tokens=256),
    (DecodeBatch.SOME, ContextLength.LONG): DecodeConfig(32, 2, 4, programs_per_sm=16, min_split_tokens=64),
    (DecodeBatch.MANY, ContextLength.SHORT): DecodeConfig(64, 4, 2, programs_per_sm=2, min_split_tokens=256),
    (DecodeBatch.MANY, ContextLength.LONG): DecodeConfig(64, 4, 2, programs_per_sm=2, min_split_tokens=256),
}
PREFILL_TABLE: dict[PrefillRows, PrefillConfig] = {
    PrefillRows.SMALL: PrefillConfig(64, 128, 4, 3),  # H200 sweep 2026-12-02: 1.24x the 64x64 tile on a 256-row extend
    PrefillRows.LARGE: PrefillConfig(128, 128, 8, 3),  # H200 sweep 2026-12-02: 1.16-1.28x 128x64 s2 (1x8k, 4x2k)
}
# A mixed step's decode rows. INLINE keeps one launch (an eager step's host cost stays as it was);
# DECODE_KERNEL adds the decode kernel's launches (split-KV for few, long decode rows).
MIXED_DECODE_ROWS = DecodeRows.INLINE
# ------------------------------------------------------------------------------------------------------

# The sweep's candidates (<= 12 each, so one GPU call times them all on every case).
DECODE_CANDIDATES: tuple[DecodeConfig, ...] = (
    DECODE_BASELINE,
    DecodeConfig(64, 4, 2, programs_per_sm=8, min_split_tokens=256),
    DecodeConfig(64, 4, 3, programs_per_sm=8, min_split_tokens=256),
    DecodeConfig(64, 4, 3, programs_per_sm=8, min_split_tokens=128),
    DecodeConfig(64, 4, 4, programs_per_sm=8, min_split_tokens=128),
    DecodeConfig(64, 4, 3, programs_per_sm=16, min_split_tokens=128),
    DecodeConfig(64, 4, 1, programs_per_sm=8, min_split_tokens=128),
    DecodeConfig(32, 4, 3, programs_per_sm=8, min_split_tokens=128),
    DecodeConfig(32, 2, 4, programs_per_sm=16, min_split_tokens=64),
    DecodeConfig(128, 4, 2, programs_per_sm=8, min_split_tokens=256),
    DecodeConfig(128, 8, 3, programs_per_sm=4, min_split_tokens=256),
    DecodeConfig(64, 8, 3, programs_per_sm=4, min_split_tokens=256),
)
PREFILL_CANDIDATES: tuple[PrefillConfig, ...] = (
    PREFILL_BASELINE[PrefillRows.SMALL],
    PREFILL_BASELINE[PrefillRows.LARGE],
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 4),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(128, 128, 8, 3),
    PrefillConfig(128, 128, 8, 4),
    PrefillConfig(128, 64, 4, 3),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 128, 4, 3),
)
# Triton documents automatic warp specialization for Blackwell; on Hopper it may fail to compile (or
# abort the compiler), so the sweep tries these last, after every other number is saved.
WARP_SPECIALIZED_CANDIDATES: tuple[PrefillConfig, ...] = (
    PrefillConfig(128, 64, 8, 3, warp_specialize=True),
    PrefillConfig(128, 128, 8, 3, warp_specialize=True),
)


def decode_shape(batch: int, num_kv_heads: int, num_sms: int,
                 max_seq_len: int | None) -> tuple[DecodeBatch, ContextLength]:
    """The shape class of a decode step; an unknown context counts as long (graph capture)."""
    pairs = batch * num_kv_heads
    size = DecodeBatch.FEW if 2 * pairs <= num_sms else DecodeBatch.SOME if pairs <= 2 * num_sms \
        else DecodeBatch.MANY
    length = ContextLength.SHORT if max_seq_len is not None and max_seq_len <= LONG_CONTEXT \
        else ContextLength.LONG
    return size, length


def decode_config(batch: int, num_kv_heads: int, num_sms: int, max_seq_len: int | None) -> DecodeConfig:
    return DECODE_TABLE[decode_shape(batch, num_kv_heads, num_sms, max_seq_len)]


def prefill_shape(num_tokens: int, group: int) -> PrefillRows:
    return PrefillRows.LARGE if num_tokens * group >= LARGE_BATCH_ROWS else PrefillRows.SMALL


def prefill_config(num_tokens: int, group: int) -> PrefillConfig:
    return PREFILL_TABLE[prefill_shape(num_tokens, group)]
