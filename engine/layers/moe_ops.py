"""The mixture-of-experts forward as three separate steps: route, compute, combine.

    routing = route_tokens(router_logits, top_k, renormalize)       # which experts, what weights
    outputs = expert_outputs(x, routing.expert_ids, w13, w2)         # [T, k, H], one row per (token, slot)
    y       = combine_expert_outputs(outputs, routing.weights)      # [T, H], the weighted sum

They are kept apart for expert parallelism: a rank that holds only some experts sends each token's
hidden state to the ranks of its experts after `route_tokens` (all-to-all), computes its own experts'
rows, and sends the rows back before `combine_expert_outputs`. Expert weights are one stacked tensor
per projection, `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and `w2 [E, H, I]`, so a
rank's experts are a slice along dim 0.

`expert_outputs` runs the fused Triton grouped GEMM on CUDA (engine/kernels/fused_moe.py) and the
torch reference below elsewhere, or with `BATON_FUSED_KERNELS=0`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import use_fused_kernels
from engine.layers.activation import silu_and_mul


@dataclass(frozen=True)
class ExpertRouting:
    weights: torch.Tensor  # [T, k] float32: each chosen expert's share of the token's output
    expert_ids: torch.Tensor  # [T, k] int64: the chosen experts, best first


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    """Softmax over every expert (in float32, as HF does), keep the top k, optionally rescaled to sum to 1.

    Renormalising the top-k softmax probabilities equals a softmax over the top-k logits (Mixtral)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ExpertRouting(weights=weights, expert_ids=ids)


def expert_outputs(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:  # [T, k, H] in x's dtype: expert_ids[t, j]'s MLP applied to x[t], unweighted
    if use_fused_kernels(x):
        from engine.kernels.fused_moe import fused_expert_outputs  # imports triton: CUDA only

        return fused_expert_outputs(x, expert_ids, w13, w2)
    return expert_outputs_reference(x, expert_ids, w13, w2)


def expert_outputs_reference(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor) -> torch.Tensor:
    """One matmul pair per expert that any token chose (HF's loop; syncs with the host per step)."""
    tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    token_of_slot = torch.arange(tokens * top_k, device=x.device) // top_k
    out = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    for expert in flat_ids.unique().tolist():
        slots = (flat_ids == expert).nonzero().squeeze(1)
        hidden = silu_and_mul(F.linear(x.index_select(0, token_of_slot[slots]), w13[expert]))
        out[slots] = F.linear(hidden, w2[expert])
    return out.view(tokens, top_k, -1)


def combine_expert_outputs(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[T, k, H], [T, k] -> [T, H]`: the routing-weighted sum, accumulated in float32."""
    return (outputs.float() * weights.unsqueeze(-1)).sum(dim=1).to(outputs.dtype)
