"""Launch configurations of the fused MoE grouped GEMMs (engine/kernels/fused_moe.py), one table.

Two regimes need opposite shapes:
- decode-like (a few rows per expert): each program's work is streaming one expert's weight tile,
  so rows per block stay small (16, the least `tl.dot` takes), K tiles are long, and N is split
  finely so that enough programs run to pull the weights at full memory bandwidth;
- prefill-like (hundreds of rows per expert): tensor-core tiles (Hopper: 128 x 128 x 64, 8 warps,
  3-4 software-pipeline stages), so each weight tile loaded is reused by many rows.

`CONFIGS` is keyed by (rows class, hidden size, expert intermediate size) -- the N/K of both GEMMs --
and falls back to `DEFAULT_CONFIGS` by rows class. `python -m lab.micro.bench_moe --sweep`
prints the winning entry of each case in this table's syntax, so adopting it is a one-line edit.
Rows per block (`block_m`) is shared by both GEMMs (one expert alignment feeds both); each GEMM has
its own tile. Every configuration that the table or the sweep can pick is checked against the torch
reference under the interpreter (tests/unit/kernels/test_moe_interpret.py) and on the GPU.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class RowsPerExpert(enum.Enum):
    """How many (token, slot) rows an expert sees on average in one call."""

    DECODE_SMALL = "decode_small"  # <= 1: most experts idle, the chosen ones see one row (batch <= E / k)
    DECODE = "decode"  # <= 8: a few rows each (Qwen3-30B-A3B: batches up to 128)
    MIXED = "mixed"  # <= 64: large decode batches, short prefills
    PREFILL = "prefill"  # more: prompts


def rows_per_expert_class(num_slots: int, num_experts: int) -> RowsPerExpert:
    per_expert = num_slots / num_experts
    for rows, bound in ((RowsPerExpert.DECODE_SMALL, 1), (RowsPerExpert.DECODE, 8), (RowsPerExpert.MIXED, 64)):
        if per_expert <= bound:
            return rows
    return RowsPerExpert.PREFILL


@dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's program shape: a block_m x block_n output tile, K walked block_k at a time."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"


@dataclass(frozen=True)
class MoeKernelConfig:
    block_m: int  # rows per block of the expert alignment; both GEMMs
    gate_up: GemmTile  # x @ w13^T with SiLU(gate) * up fused into the epilogue: N = I, K = H
    down: GemmTile  # act @ w2^T: N = H, K = I

    def __str__(self) -> str:
        return f"m{self.block_m} up {self.gate_up} down {self.down}"

    @property
    def shared_memory_bytes(self) -> int:
        """The gate_up GEMM's pipeline buffers (the larger GEMM: gate and up tiles), 16-bit operands."""
        up = self.gate_up
        return 2 * (self.block_m * up.block_k + 2 * up.block_n * up.block_k) * up.num_stages


DEFAULT_CONFIGS: dict[RowsPerExpert, MoeKernelConfig] = {
    RowsPerExpert.DECODE_SMALL: MoeKernelConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    RowsPerExpert.DECODE: MoeKernelConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    RowsPerExpert.MIXED: MoeKernelConfig(32, GemmTile(64, 64, 4, 4), GemmTile(64, 64, 4, 4)),
    RowsPerExpert.PREFILL: MoeKernelConfig(64, GemmTile(128, 64, 4, 4), GemmTile(128, 64, 4, 4)),
}

# (rows class, hidden, moe intermediate) -> config: measured winners of `bench_moe --sweep`.
CONFIGS: dict[tuple[RowsPerExpert, int, int], MoeKernelConfig] = {
    # Qwen3-30B-A3B (hidden 2048, expert intermediate 768): `bench_moe --sweep` on one H200, 2026-12-02
    (RowsPerExpert.DECODE_SMALL, 2048, 768): MoeKernelConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4)),
    # (the sweep's 128x128 s3 up tile, 191.8 us, is over the table's shared-memory budget; 64x128 s4 took 192.1)
    (RowsPerExpert.DECODE, 2048, 768): MoeKernelConfig(16, GemmTile(64, 128, 4, 4), GemmTile(16, 128, 2, 4)),
    (RowsPerExpert.PREFILL, 2048, 768): MoeKernelConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3)),
}

# What a candidate's pipeline buffers may take: an H100/H200 SM has 228 KB, less what Triton reserves.
SHARED_MEMORY_BUDGET = 200 * 1024

# Above this many (token, slot) pairs the expert alignment runs as torch ops (a sort) instead of the
# single-program Triton kernel, whose serial passes over the slots would then cost more than a sort.
FUSED_ALIGN_MAX_SLOTS = 4096


def config_for(num_slots: int, num_experts: int, hidden: int, intermediate: int) -> MoeKernelConfig:
    rows = rows_per_expert_class(num_slots, num_experts)
    return CONFIGS.get((rows, hidden, intermediate), DEFAULT_CONFIGS[rows])


def table_entry(rows: RowsPerExpert, hidden: int, intermediate: int, config: MoeKernelConfig) -> str:
    """`CONFIGS`' line for a measured winner, as the sweep prints it."""
    up, down = config.gate_up, config.down
    return (f"    (RowsPerExpert.{rows.name}, {hidden}, {intermediate}): MoeKernelConfig({config.block_m}, "
            f"GemmTile({up.block_n}, {up.block_k}, {up.num_warps}, {up.num_stages}), "
            f"GemmTile({down.block_n}, {down.block_k}, {down.num_warps}, {down.num_stages})),")


@contextmanager
def table_entries(entries: dict[tuple[RowsPerExpert, int, int], MoeKernelConfig]) -> Iterator[None]:
    """`CONFIGS` with `entries` added, inside the block: the sweep's hook for running the whole model
    on its winners. Not thread-safe; CUDA graphs captured inside keep the configurations they saw."""
    previous = dict(CONFIGS)
    CONFIGS.update(entries)
    try:
        yield
    finally:
        CONFIGS.clear()
        CONFIGS.update(previous)


def sweep_candidates(rows: RowsPerExpert) -> list[MoeKernelConfig]:
    """The configurations `bench_moe --sweep` times for a rows class (<= 12 each; the table's entry
    first). The same tile serves both GEMMs in a candidate; the sweep times each GEMM on its own, so
    the best gate_up and the best down tile are chosen separately. Every candidate keeps its
    `shared_memory_bytes` within SHARED_MEMORY_BUDGET; a tile that still fails to launch is an error
    row of the sweep, never its pick."""
    if rows is RowsPerExpert.PREFILL:
        tiles = [(64, GemmTile(128, 64, 4, 4)), (64, GemmTile(128, 64, 8, 3)), (64, GemmTile(64, 64, 4, 4)),
                 (64, GemmTile(128, 128, 8, 2)), (64, GemmTile(256, 64, 8, 2)), (128, GemmTile(128, 64, 8, 3)),
                 (128, GemmTile(128, 64, 8, 4)), (128, GemmTile(64, 64, 4, 4)), (128, GemmTile(64, 64, 8, 3)),
                 (128, GemmTile(256, 32, 8, 3)), (64, GemmTile(64, 128, 4, 3))]
    elif rows is RowsPerExpert.MIXED:
        tiles = [(32, GemmTile(64, 64, 4, 4)), (32, GemmTile(64, 128, 4, 3)), (32, GemmTile(128, 64, 4, 4)),
                 (16, GemmTile(64, 128, 4, 4)), (64, GemmTile(64, 64, 4, 4)), (64, GemmTile(128, 64, 4, 4)),
                 (64, GemmTile(128, 64, 8, 3)), (32, GemmTile(128, 128, 8, 2))]
    else:  # decode
        tiles = [(16, GemmTile(64, 64, 4, 3)), (16, GemmTile(32, 128, 4, 4)), (16, GemmTile(64, 128, 4, 4)),
                 (16, GemmTile(32, 256, 4, 3)), (16, GemmTile(64, 256, 4, 2)), (16, GemmTile(16, 256, 4, 4)),
                 (16, GemmTile(128, 128, 4, 2)), (16, GemmTile(64, 256, 8, 2)), (16, GemmTile(32, 64, 2, 5)),
                 (16, GemmTile(16, 128, 2, 4)), (32, GemmTile(64, 128, 4, 4))]
    default = DEFAULT_CONFIGS[rows]
    candidates = [default] + [MoeKernelConfig(m, tile, tile) for m, tile in tiles]
    return list(dict.fromkeys(candidates))[:12]
