"""The profile grid: which prefill and decode shapes `baton profile` measures."""

from __future__ import annotations

import pytest

from services.profiler.grid import DecodePoint, PrefillPoint, build_grid


def test_full_grid_spans_short_prompts_to_half_the_window_and_adds_cached_prefixes():
    grid = build_grid(max_model_len=8192, max_num_seqs=64)
    uncached = [p.new_tokens for p in grid.prefill if p.cached_tokens == 0]
    assert uncached == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    cached = [p for p in grid.prefill if p.cached_tokens]
    assert cached == [PrefillPoint(1024, 2048), PrefillPoint(512, 3072)]
    assert all(p.new_tokens + p.cached_tokens <= 4096 for p in cached)


def test_full_decode_grid_ends_at_max_num_seqs_even_off_the_ladder():
    grid = build_grid(max_model_len=2048, max_num_seqs=48)
    assert sorted({d.batch for d in grid.decode}) == [1, 2, 4, 8, 16, 32, 48]
    assert sorted({d.context_per_seq for d in grid.decode}) == [64, 256, 1024]


def test_quick_grid_is_small_and_capped_by_the_limits():
    grid = build_grid(max_model_len=8192, max_num_seqs=8, quick=True)
    assert [p.new_tokens for p in grid.prefill if not p.cached_tokens] == [16, 32, 64, 128, 256]
    assert [p for p in grid.prefill if p.cached_tokens] == [PrefillPoint(64, 128)]
    assert {d.batch for d in grid.decode} == {1, 4, 8}
    assert len(grid.decode) == 6


def test_points_name_the_cost_model_features():
    assert PrefillPoint(new_tokens=10, cached_tokens=5).attention_tokens_sq == 10 * (10 + 2 * 5)
    assert DecodePoint(batch=4, context_per_seq=100).context_tokens == 400


def test_a_window_too_small_to_profile_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        build_grid(max_model_len=16, max_num_seqs=4)
