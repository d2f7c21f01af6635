"""Expert alignment for the fused MoE GEMMs: the T*k (token, slot) pairs grouped by expert.

Each expert's run of slots is padded to a multiple of `block_m` rows with an out-of-range slot id
(`num_slots`), so every `block_m`-row block of the sorted order belongs to one expert
(`block_experts`). Output sizes depend only on (T, k, E, block_m), so neither path syncs with the
host and both can be captured in a CUDA graph. Two implementations, identical results:
- `_align_kernel`: one Triton program, two serial passes over the slots (count per expert, then
  place each slot at its group's start + its rank among earlier slots of the same expert). One
  launch instead of ~25 small torch ops: what a decode step (8 to ~1k slots) wants.
- `align_slots_to_experts_torch`: a stable sort and scatters; for prefill-sized inputs, where one
  program's serial passes would be slower than a device-wide sort.
- One token (batch-1 decode) needs no sort at all: its k slots chose k distinct experts, so each
  slot is a block of its own, the expert ids are the block experts, and the rest is a constant
  (`align_single_token`: no launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch
import triton
import triton.language as tl

from engine.kernels.fused_moe_configs import FUSED_ALIGN_MAX_SLOTS
from engine.kernels.kv_store import check_launch_device


@dataclass(frozen=True)
class ExpertAlignment:
    """Token slots grouped by expert, each group padded to whole blocks of `block_m` rows."""

    sorted_slots: torch.Tensor  # [num_blocks * block_m] int32: slot (t * k + j) per row; num_slots = padding
    block_experts: torch.Tensor  # [num_blocks] int32 or int64: the expert of each block (>= E past the end)
    num_padded_rows: torch.Tensor  # [1] int32: rows in use (the sum of the padded group sizes)
    num_slots: int  # T * k
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.shape[0]


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """At most min(E, slots) groups are non-empty, each wasting at most block_m - 1 rows."""
    return -(-(num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m)


def align_slots_to_experts(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Group the flattened slots of `expert_ids [T, k]` by expert (stable: slot order within a group).
    Each row's experts must be distinct (top-k's are)."""
    if expert_ids.shape[0] == 1:
        single = align_single_token(expert_ids, block_m)
        if single is not None:
            return single
    if expert_ids.numel() <= FUSED_ALIGN_MAX_SLOTS:
        return align_slots_to_experts_fused(expert_ids, num_experts, block_m)
    return align_slots_to_experts_torch(expert_ids, num_experts, block_m)


_SINGLE_TOKEN_ROWS: Final[dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]]] = {}


def align_single_token(expert_ids: torch.Tensor, block_m: int) -> ExpertAlignment | None:
    """`[1, k]` distinct experts: block j holds slot j alone (rows j * block_m), its expert is
    `expert_ids[0, j]`. The constant rows are made once per (device, k, block_m), outside any CUDA
    graph capture (made during one, they would hold nothing until a replay): None then, and the
    caller aligns the usual way."""
    top_k = expert_ids.shape[1]
    key = (expert_ids.device, top_k, block_m)
    if key not in _SINGLE_TOKEN_ROWS:
        if expert_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        rows = torch.full((top_k, block_m), top_k, dtype=torch.int32, device=expert_ids.device)
        rows[:, 0] = torch.arange(top_k, dtype=torch.int32, device=expert_ids.device)
        _SINGLE_TOKEN_ROWS[key] = (rows.view(-1), torch.tensor([top_k * block_m], dtype=torch.int32,
                                                                device=expert_ids.device))
    sorted_slots, num_padded_rows = _SINGLE_TOKEN_ROWS[key]
    return ExpertAlignment(sorted_slots, expert_ids.reshape(-1), num_padded_rows, top_k, block_m)


def align_slots_to_experts_torch(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    flat = expert_ids.reshape(-1).to(torch.int64)
    num_slots, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount's output size would need a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    group_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank_in_group = torch.arange(num_slots, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    rows = (group_end - padded)[expert_of_sorted] + rank_in_group
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[rows] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(group_end, block_start, right=True).to(torch.int32)
    return ExpertAlignment(sorted_slots, block_experts, group_end[-1:].to(torch.int32), num_slots, block_m)


@triton.jit
def _align_kernel(
    ids_ptr,  # [num_slots] int: the expert of each slot, in [0, num_experts)
    sorted_slots_ptr,  # [num_blocks * BLOCK_M] int32, written in full
    block_experts_ptr,  # [num_blocks] int32, written in full
    num_padded_rows_ptr,  # [1] int32
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,  # num_experts rounded up to a power of two; the extra experts stay empty
    CHUNK: tl.constexpr,  # slots (or rows) per step of a pass
):
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for s0 in range(0, num_slots, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_end = tl.cumsum(padded, axis=0)
    group_start = group_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_rows_ptr, total)
    # Rows that hold no slot: each group's tail, then everything past the last group. The slot pass
    # below writes exactly the other rows, so no row is written twice (no ordering between passes needed).
    for j in range(0, BLOCK_M):
        tl.store(sorted_slots_ptr + group_start + counts + j, num_slots, mask=counts + j < padded)
    for r0 in range(total, num_blocks * BLOCK_M, CHUNK * 8):
        rows = r0 + tl.arange(0, CHUNK * 8)
        tl.store(sorted_slots_ptr + rows, num_slots, mask=rows < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        expert = tl.sum((group_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)
    placed = tl.zeros((E_PAD,), dtype=tl.int32)  # slots of each expert placed by earlier chunks
    for s0 in range(0, num_slots, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier slots of the same expert in this chunk
        row = tl.sum(onehot * (group_start + placed + before), axis=1)
        tl.store(sorted_slots_ptr + row, offs, mask=offs < num_slots)
        placed += tl.sum(onehot, axis=0)


def align_slots_to_experts_fused(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    flat = expert_ids.reshape(-1)
    check_launch_device(_align_kernel, expert_ids=flat)
    num_slots, device = flat.numel(), flat.device
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded_rows = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](flat, sorted_slots, block_experts, num_padded_rows, num_slots, num_blocks,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, 4096 // e_pad), num_warps=4)
    return ExpertAlignment(sorted_slots, block_experts, num_padded_rows, num_slots, block_m)
