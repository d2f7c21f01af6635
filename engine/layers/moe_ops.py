"""The mixture-of-experts forward as three separate steps: route, compute, combine.

    routing = route_tokens(router_logits, top_k, renormalize)       # which experts, what weights
    outputs = expert_outputs(x, routing.expert_ids, w13, w2)         # [T, k, H], one row per (token, slot)
    y       = combine_expert_outputs(outputs, routing.weights)      # [T, H], the weighted sum

They are kept apart for expert parallelism: a rank that holds only some experts sends each token's
hidden state to the ranks of its experts after `route_tokens` (all-to-all), computes its own experts'
rows, and sends the rows back before `combine_expert_outputs`. Expert weights are one stacked tensor
per projection, `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and `w2 [E, H, I]`, so a
rank's experts are a slice along dim 0.

On CUDA each step is Triton (`expert_outputs`: the grouped GEMM of engine/kernels/fused_moe.py;
`route_tokens` and `combine_expert_outputs`: one kernel each, engine/kernels/moe_route.py, where
torch would launch four or five small ops per layer); the torch code below runs elsewhere, or with
`BATON_FUSED_KERNELS=0`, and is the reference the kernels are tested against.

FP8 experts pass their e4m3 stacks with `w13_scale` / `w2_scale` (per-row or 128 x 128 block layouts:
engine/kernels/fused_moe.py); the reference dequantizes one expert at a time (`dequantize_expert`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import use_fused_kernels
from engine.layers.activation import silu_and_mul
from engine.moe_config import GroupedRouting, GroupScore, RouterScoring
from engine.quant.fp8 import dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows


@dataclass(frozen=True)
class ExpertRouting:
    weights: torch.Tensor  # [T, k] float32: each chosen expert's share of the token's output
    expert_ids: torch.Tensor  # [T, k] int64: the chosen experts, best first


def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    """Softmax over every expert (in float32, as HF does), keep the top k, optionally rescaled to sum to 1.

    Renormalising the top-k softmax probabilities equals a softmax over the top-k logits (Mixtral)."""
    if use_fused_kernels(router_logits) and router_logits.dim() == 2:
        from engine.kernels.moe_route import route_top_k  # imports triton: CUDA only

        weights, ids = route_top_k(router_logits, top_k, renormalize)
        return ExpertRouting(weights=weights, expert_ids=ids)
    return route_tokens_reference(router_logits, top_k, renormalize)


def route_tokens_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ExpertRouting(weights=weights, expert_ids=ids)


def route_tokens_grouped(router_logits: torch.Tensor, top_k: int, renormalize: bool, routing: GroupedRouting,
                         correction_bias: torch.Tensor | None) -> ExpertRouting:
    """DeepSeek's routing (engine/moe_config.py): keep each token's best `topk_groups` expert groups,
    pick the top k experts inside them by score (+ the V3 correction bias), weight them by their
    unbiased scores, optionally renormalised, times `routed_scaling_factor`. All in float32, as HF."""
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if routing.scoring is RouterScoring.SOFTMAX else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.num_groups > 1:
        grouped = choice.view(choice.shape[0], routing.num_groups, -1)
        group_scores = (grouped.max(dim=-1).values if routing.group_score is GroupScore.MAX
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))
        kept = torch.topk(group_scores, routing.topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ExpertRouting(weights=weights * routing.routed_scaling_factor, expert_ids=ids)


def expert_outputs(
    x: torch.Tensor,  # [T, H]
    expert_ids: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H] in x's dtype, or e4m3 with w13_scale
    w2: torch.Tensor,  # [E, H, I] in x's dtype, or e4m3 with w2_scale
    w13_scale: torch.Tensor | None = None,  # FP8 dequantization scales (layouts: engine/kernels/fused_moe.py)
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, k, H] in x's dtype: expert_ids[t, j]'s MLP applied to x[t], unweighted
    if use_fused_kernels(x):
        from engine.kernels.fused_moe import fused_expert_outputs  # imports triton: CUDA only

        return fused_expert_outputs(x, expert_ids, w13, w2, w13_scale=w13_scale, w2_scale=w2_scale)
    return expert_outputs_reference(x, expert_ids, w13, w2, w13_scale, w2_scale)


def expert_outputs_reference(x: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             w13_scale: torch.Tensor | None = None,
                             w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One matmul pair per expert that any token chose (HF's loop; syncs with the host per step). FP8
    experts are dequantized one at a time as they are used, so memory holds only their e4m3 bytes; their
    matmuls run in float32 and round where the kernel rounds (after each GEMM)."""
    tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    token_of_slot = torch.arange(tokens * top_k, device=x.device) // top_k
    out = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    for expert in flat_ids.unique().tolist():
        slots = (flat_ids == expert).nonzero().squeeze(1)
        rows = x.index_select(0, token_of_slot[slots])
        if w13_scale is None or w2_scale is None:
            out[slots] = F.linear(silu_and_mul(F.linear(rows, w13[expert])), w2[expert])
            continue
        gate_up = F.linear(rows.float(), dequantize_expert(w13[expert], w13_scale[expert], halves=2))
        hidden = silu_and_mul(gate_up.to(x.dtype))
        out[slots] = F.linear(hidden.float(), dequantize_expert(w2[expert], w2_scale[expert], halves=1)).to(x.dtype)
    return out.view(tokens, top_k, -1)


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor, halves: int) -> torch.Tensor:
    """float32 values of one FP8 expert's `[N, K]` weight: per-row `scale [N]`, or 128 x 128 blocks
    `scale [halves * ceil(N / halves / 128), ceil(K/128)]`, each of the `halves` row ranges (w13's gate
    and up) scaled by its own blocks (engine/kernels/fused_moe.py's layouts)."""
    if scale.dim() == 1:
        return dequantize_rows(weight, scale)
    parts = zip(weight.chunk(halves), scale.chunk(halves), strict=True)
    return torch.cat([dequantize_blocks(w, s) for w, s in parts])


@dataclass(frozen=True)
class Fp8Experts:
    """Stacked experts in e4m3 with their dequantization scales, in the fused kernel's layouts."""

    w13: torch.Tensor  # [E, 2I, H] float8_e4m3fn
    w13_scale: torch.Tensor  # [E, 2I] per row, or [E, 2 * ceil(I/128), ceil(H/128)] blocks (gate's, then up's)
    w2: torch.Tensor  # [E, H, I] float8_e4m3fn
    w2_scale: torch.Tensor  # [E, H] per row, or [E, ceil(H/128), ceil(I/128)] blocks


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, blocked: bool) -> Fp8Experts:
    """Stacked float experts -> e4m3 and scales (per row, or 128 x 128 blocks with w13's gate and up halves
    scaled apart, as a checkpoint scales each projection): for benchmarks and tests; a model's experts
    quantize as they load (engine/layers/stacked_experts.py)."""
    quantize = quantize_blocks if blocked else quantize_rows

    def stack(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [quantize(w) for w in weights]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    (gate, gate_scale), (up, up_scale) = (stack(half) for half in w13.chunk(2, dim=1))
    w2q, w2_scale = stack(w2)
    return Fp8Experts(torch.cat([gate, up], dim=1), torch.cat([gate_scale, up_scale], dim=1), w2q, w2_scale)


def combine_expert_outputs(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[T, k, H], [T, k] -> [T, H]`: the routing-weighted sum, accumulated in float32."""
    if use_fused_kernels(outputs):
        from engine.kernels.moe_route import combine_weighted  # imports triton: CUDA only

        return combine_weighted(outputs, weights)
    return combine_expert_outputs_reference(outputs, weights)


def combine_expert_outputs_reference(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (outputs.float() * weights.unsqueeze(-1)).sum(dim=1).to(outputs.dtype)
