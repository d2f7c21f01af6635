"""engine/kernels/fused_moe_configs.py: which launch configuration a call gets, and the sweep's hooks."""

from __future__ import annotations

import pytest

from engine.kernels import fused_moe_configs as table
from engine.kernels.fused_moe_configs import (
    DEFAULT_CONFIGS,
    GemmTile,
    MoeKernelConfig,
    RowsPerExpert,
    config_for,
    rows_per_expert_class,
    sweep_candidates,
    table_entries,
    table_entry,
)

QWEN3 = dict(num_experts=128, hidden=2048, intermediate=768)
TUNED = MoeKernelConfig(16, GemmTile(16, 256, 2, 5), GemmTile(32, 256, 4, 3))


@pytest.mark.parametrize(("tokens", "rows"), [
    (1, RowsPerExpert.DECODE_SMALL), (16, RowsPerExpert.DECODE_SMALL), (17, RowsPerExpert.DECODE),
    (128, RowsPerExpert.DECODE), (129, RowsPerExpert.MIXED), (1024, RowsPerExpert.MIXED),
    (1025, RowsPerExpert.PREFILL), (4096, RowsPerExpert.PREFILL)])
def test_rows_class_follows_rows_per_expert_at_top_8_of_128(tokens: int, rows: RowsPerExpert) -> None:
    assert rows_per_expert_class(tokens * 8, 128) is rows


def test_a_shape_entry_wins_over_the_class_default_and_only_for_its_shape() -> None:
    shape = {"num_experts": 128, "hidden": 1024, "intermediate": 384}  # a shape the table has no entry for
    with table_entries({(RowsPerExpert.DECODE, 1024, 384): TUNED}):
        assert config_for(64 * 8, **shape) == TUNED
        assert config_for(64 * 8, 128, 4096, 384) == DEFAULT_CONFIGS[RowsPerExpert.DECODE]  # another shape
        assert config_for(8, **shape) == DEFAULT_CONFIGS[RowsPerExpert.DECODE_SMALL]  # another class
    assert config_for(64 * 8, **shape) == DEFAULT_CONFIGS[RowsPerExpert.DECODE]  # restored on exit


def test_table_entries_restore_the_table_after_an_error() -> None:
    before = dict(table.CONFIGS)
    with pytest.raises(RuntimeError), table_entries({(RowsPerExpert.PREFILL, 1, 1): TUNED}):
        raise RuntimeError("boom")
    assert before == table.CONFIGS


def test_the_printed_table_line_is_the_entry_itself() -> None:
    line = table_entry(RowsPerExpert.MIXED, 2048, 768, TUNED)
    parsed = eval("{" + line + "}", {"RowsPerExpert": RowsPerExpert, "MoeKernelConfig": MoeKernelConfig,  # noqa: S307
                                     "GemmTile": GemmTile})
    assert parsed == {(RowsPerExpert.MIXED, 2048, 768): TUNED}


@pytest.mark.parametrize("rows", list(RowsPerExpert))
def test_sweep_candidates_start_with_the_default_and_stay_within_twelve(rows: RowsPerExpert) -> None:
    candidates = sweep_candidates(rows)
    assert candidates[0] == DEFAULT_CONFIGS[rows] and len(set(candidates)) == len(candidates) <= 12
    # tl.dot takes 16 rows at least, and tl.arange powers of two only
    assert all(c.block_m >= 16 and c.block_m & (c.block_m - 1) == 0 for c in candidates)


def test_every_table_entry_and_candidate_fits_the_shared_memory_budget() -> None:
    configs = [*DEFAULT_CONFIGS.values(), *table.CONFIGS.values(),
               *(c for rows in RowsPerExpert for c in sweep_candidates(rows))]
    assert all(c.shared_memory_bytes <= table.SHARED_MEMORY_BUDGET for c in configs)
    # 128 rows x 64 deep + gate and up 128 x 64, bf16, 3 stages
    assert MoeKernelConfig(128, GemmTile(128, 64, 8, 3), GemmTile(1, 1, 1, 1)).shared_memory_bytes == 147456
