"""Shape classes, split counts and tables of engine/kernels/attention_tiles.py (pure Python, no kernels)."""

from __future__ import annotations

import pytest

from engine.kernels.attention_tiles import (
    DECODE_BASELINE,
    DECODE_CANDIDATES,
    DECODE_TABLE,
    MAX_SPLITS,
    PREFILL_BASELINE,
    PREFILL_CANDIDATES,
    PREFILL_TABLE,
    ContextLength,
    DecodeBatch,
    DecodeConfig,
    PrefillRows,
    decode_config,
    decode_shape,
    prefill_shape,
)

H100_SMS = 132


@pytest.mark.parametrize(
    ("batch", "max_seq_len", "expected"),
    [
        (1, 8192, (DecodeBatch.FEW, ContextLength.LONG)),
        (8, 8192, (DecodeBatch.FEW, ContextLength.LONG)),  # 64 (sequence, KV head) pairs <= 66
        (9, 1024, (DecodeBatch.SOME, ContextLength.SHORT)),
        (32, 2048, (DecodeBatch.SOME, ContextLength.SHORT)),  # 256 pairs <= 264
        (64, 4096, (DecodeBatch.MANY, ContextLength.LONG)),
        (128, None, (DecodeBatch.MANY, ContextLength.LONG)),  # graph capture: context unknown, long
    ],
)
def test_decode_shape_class_compares_the_batch_with_the_multiprocessors(
    batch: int, max_seq_len: int | None, expected: tuple[DecodeBatch, ContextLength]
) -> None:
    assert decode_shape(batch, 8, H100_SMS, max_seq_len) == expected


def test_split_count_targets_programs_per_multiprocessor() -> None:
    config = DecodeConfig(64, 4, 3, programs_per_sm=8, min_split_tokens=128)
    assert config.num_splits(8, 8, H100_SMS, 8192) == 17  # ceil(8 * 132 / 64) programs per pair
    assert config.num_splits(64, 8, H100_SMS, 4096) == 3
    assert config.num_splits(1024, 8, H100_SMS, 4096) == 1  # the batch alone fills the card


def test_split_count_is_capped_by_tokens_per_split_and_by_the_maximum() -> None:
    config = DecodeConfig(64, 4, 3, programs_per_sm=8, min_split_tokens=128)
    assert config.num_splits(1, 8, H100_SMS, 300) == 3  # 300 tokens: no split under 128 tokens
    assert config.num_splits(1, 8, H100_SMS, 1 << 20) == MAX_SPLITS
    assert config.num_splits(1, 8, H100_SMS, None) == MAX_SPLITS  # capture: a function of the batch alone
    assert config.num_splits(0, 8, H100_SMS, 0) == 1  # an empty batch or context still launches one


def test_the_baseline_reproduces_the_split_counts_before_the_tables() -> None:
    """The pre-sweep rule was two waves of programs, capped at 256 tokens a split and 32 splits."""
    assert DECODE_BASELINE.num_splits(1, 8, H100_SMS, 8192) == 32
    assert DECODE_BASELINE.num_splits(8, 8, H100_SMS, 8192) == 5
    assert DECODE_BASELINE.num_splits(64, 8, H100_SMS, 4096) == 1


def test_prefill_shape_class_counts_query_rows_times_the_group() -> None:
    assert prefill_shape(1023, 4) == PrefillRows.SMALL
    assert prefill_shape(1024, 4) == PrefillRows.LARGE


def test_tables_cover_every_class_and_name_launchable_tiles() -> None:
    assert set(DECODE_TABLE) == {(b, c) for b in DecodeBatch for c in ContextLength}
    assert set(PREFILL_TABLE) == set(PrefillRows) == set(PREFILL_BASELINE)
    for config in (*DECODE_TABLE.values(), *DECODE_CANDIDATES):
        assert config.block_n >= 16 and config.block_n & (config.block_n - 1) == 0
        assert config.programs_per_sm >= 1 and config.min_split_tokens >= config.block_n
    for prefill in (*PREFILL_TABLE.values(), *PREFILL_CANDIDATES):
        assert prefill.block_m >= 16 and prefill.block_m & (prefill.block_m - 1) == 0
        assert prefill.block_n >= 16 and prefill.block_n & (prefill.block_n - 1) == 0


def test_the_sweep_measures_the_baseline_and_at_most_twelve_candidates() -> None:
    assert DECODE_CANDIDATES[0] == DECODE_BASELINE and len(DECODE_CANDIDATES) <= 12
    assert set(PREFILL_BASELINE.values()) <= set(PREFILL_CANDIDATES) and len(PREFILL_CANDIDATES) <= 12


def test_decode_config_reads_the_table() -> None:
    assert decode_config(1, 8, H100_SMS, 8192) is DECODE_TABLE[(DecodeBatch.FEW, ContextLength.LONG)]
