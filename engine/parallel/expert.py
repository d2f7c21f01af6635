"""Expert parallelism: each of `size` ranks holds `num_experts / size` experts of every MoE block.

Attention and the dense layers are replicated (every rank runs them on the whole batch, over its own
full KV cache), so every rank enters an MoE block with the same hidden states `x [T, H]`. The block
then splits the work by tokens and by experts (the shape of vLLM's, SGLang's and DeepEP's dispatch /
combine, over plain `torch.distributed`):

1. Every rank routes every token (the router is tiny and replicated), so the routing, and the
   per-expert token counts the worker exports, are the same on all ranks. Rank r keeps its slice of
   the tokens, `token_slice`.
2. Dispatch: the slice's (token, slot) pairs are sorted by the rank that owns their expert; the
   counts go first (`all_to_all_single` of one int per rank), then the hidden rows and the experts'
   local ids, each by `all_to_all_single` with those split sizes.
3. Each rank runs its own experts on the rows it received (`expert_outputs`: the fused kernel on
   CUDA, the torch reference elsewhere; each row is a token with k = 1).
4. Combine: the reverse `all_to_all_single` brings every output row back to its source rank, which
   un-sorts them into `[t, k, H]` and takes the routing-weighted sum there.
5. The slices are all-gathered (padded to equal length), so every rank leaves with `[T, H]` again.

The collectives go over the default process group (NCCL on CUDA, gloo on CPU: torch 2.13's gloo has
`all_to_all_single` with uneven splits). The exchanged counts are read on the host, so a step under
expert parallelism cannot be captured in a CUDA graph: the model runner runs it eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import ConfigError

# torch 2.13 renamed all_gather_into_tensor; the GPU image's torch 2.11 only has the old name.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Runs this rank's experts: `(x [R, H], local expert ids [R, 1]) -> [R, 1, H]`.
LocalExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the collectives' ProcessGroup; None: the default group

    def experts_per_rank(self, num_experts: int) -> int:
        if num_experts % self.size:
            raise ConfigError(f"num_experts ({num_experts}) is not divisible by expert_parallel_size ({self.size})")
        return num_experts // self.size

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        per_rank = self.experts_per_rank(num_experts)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def token_slice(self, num_tokens: int) -> tuple[int, int]:
        """`(start, end)` of this rank's tokens: `ceil(T / size)` each, the last ranks may get fewer or none."""
        per_rank = -(-num_tokens // self.size)
        return min(self.rank * per_rank, num_tokens), min((self.rank + 1) * per_rank, num_tokens)


def check_expert_parallel(num_experts: int | None, ep_size: int) -> None:
    """Reject expert parallelism for a dense model or an expert count that does not divide."""
    if ep_size == 1:
        return
    if num_experts is None:
        raise ConfigError(f"expert_parallel_size {ep_size} needs a mixture-of-experts model; this one is dense")
    ExpertParallel(size=ep_size).experts_per_rank(num_experts)


def dispatch_compute_combine(ep: ExpertParallel, x: torch.Tensor, expert_ids: torch.Tensor,
                             num_experts: int, run_local: LocalExperts) -> torch.Tensor:
    """`x [t, H]` (this rank's token slice), `expert_ids [t, k]` (global ids) -> `[t, k, H]`: each slot's
    expert output, computed on the rank that holds the expert (steps 2-4 of the module docstring)."""
    tokens, top_k = expert_ids.shape
    per_rank = ep.experts_per_rank(num_experts)
    flat_ids = expert_ids.reshape(-1)
    dest = flat_ids // per_rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=ep.size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()

    rows = x.index_select(0, order // top_k)  # slot s belongs to token s // k
    local_ids = (flat_ids[order] % per_rank).unsqueeze(1)
    recv_x = _exchange(rows, sends, recvs, ep)
    recv_ids = _exchange(local_ids, sends, recvs, ep)
    out = run_local(recv_x, recv_ids).reshape(-1, x.shape[1]) if recv_x.shape[0] else recv_x
    back = _exchange(out.contiguous(), recvs, sends, ep)  # the reverse split: rows return to their source
    result = torch.empty_like(back)
    result[order] = back
    return result.view(tokens, top_k, x.shape[1])


def gather_token_slices(ep: ExpertParallel, part: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every rank's `token_slice` rows, in rank order: `[t_r, H]` per rank -> `[T, H]` on every rank."""
    per_rank = -(-num_tokens // ep.size)
    padded = part.new_zeros((per_rank, part.shape[1]))
    padded[: part.shape[0]] = part
    out = part.new_empty((ep.size * per_rank, part.shape[1]))
    all_gather_flat(out, padded, group=ep.group)
    return out[:num_tokens]


def _exchange(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], ep: ExpertParallel) -> torch.Tensor:
    out = t.new_empty((sum(recv_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t, recv_splits, send_splits, group=ep.group)
    return out
