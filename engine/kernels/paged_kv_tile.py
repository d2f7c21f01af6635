"""Device helpers shared by the paged decode and prefill kernels: find a key tile's rows, load a K/V tile.

A tile is `BLOCK_N` consecutive context positions of one sequence and one KV head. Its rows live in
the pages its block-table entries name, `PAGE_SIZE` tokens a page, so the tile is gathered row by row
(each row `D` contiguous elements) through the block table: any page size works, and a tile may span
pages. `load_kv_tile` is the one place that turns cache elements into `tl.dot` operands, so that a
quantized cache (load, convert, multiply by a scale) changes this function alone.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_rows(block_table_row, offs_n, mask_n, stride_cb, stride_cs, PAGE_SIZE: tl.constexpr):
    """Element offset of each position's row in the layer view: [BLOCK_N] int64."""
    block_ids = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
    return block_ids.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs


@triton.jit
def load_kv_tile(base, rows, offs_d, mask_n, mask_d, DOT_DTYPE: tl.constexpr, EVEN_D: tl.constexpr):
    """K or V rows `rows` of one KV head as a [BLOCK_N, BLOCK_D] `tl.dot` operand; masked rows read 0.

    EVEN_D (head_dim == BLOCK_D) leaves the head-dim mask out, so the row loads stay full-width
    vectors whatever the compiler can prove about a runtime `head_dim`.
    """
    if EVEN_D:  # noqa: SIM108 - a constexpr branch, resolved at compile time
        mask = mask_n[:, None]
    else:
        mask = mask_n[:, None] & mask_d[None, :]
    return tl.load(base + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)
