"""The MoE block's routing and combine as one Triton kernel each (the torch versions: engine/layers/moe_ops.py).

In a decode step every op is a launch of a few microseconds, and the torch route (cast, softmax,
top-k, sum, divide) and combine (cast, multiply, sum, cast) cost nine launches per layer for a few
kilobytes of data. Same arithmetic as the torch path:
- `route_top_k`: softmax over every expert in float32, the top k best first (ties: the lower expert
  id), optionally rescaled to sum to 1;
- `combine_weighted`: sum_j weight_j * output_j accumulated in float32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_launch_device


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E], row stride stride_l
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # TOP_K rounded up to a power of two
    E_PAD: tl.constexpr,  # num_experts rounded up to a power of two
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    valid = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=valid, other=float("-inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, exp / tl.sum(exp, axis=0), -1.0)  # -1: never chosen
    slots = tl.arange(0, K_PAD)
    chosen_w = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen_id = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, experts, E_PAD), axis=0)
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_id = tl.where(slots == j, best_id, chosen_id)
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, chosen_w, mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, chosen_id.to(tl.int64), mask=keep)


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, E]` logits -> (weights [T, k] float32, expert ids [T, k] int64), best first."""
    if router_logits.dim() != 2 or router_logits.stride(-1) != 1 or not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(f"need [T, E] logits with unit column stride and 0 < top_k <= E, got "
                         f"{tuple(router_logits.shape)} strides {router_logits.stride()}, top_k {top_k}")
    check_launch_device(_route_kernel, logits=router_logits)
    tokens, num_experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                 K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts),
                                 RENORMALIZE=renormalize, num_warps=1 if num_experts <= 128 else 4)
    return weights, ids


BLOCK_H = 1024


@triton.jit
def _combine_kernel(
    outputs_ptr,  # [T, TOP_K, H] contiguous
    weights_ptr,  # [T, TOP_K] contiguous
    y_ptr,  # [T, H] contiguous, outputs' dtype
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        out = tl.load(outputs_ptr + (token * TOP_K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        acc += out * weight
    tl.store(y_ptr + token * hidden + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine_weighted(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[T, k, H], [T, k] -> [T, H]` in outputs' dtype: the routing-weighted sum over the k slots."""
    if outputs.dim() != 3 or weights.shape != outputs.shape[:2]:
        raise ValueError(f"need outputs [T, k, H] and weights [T, k], got {tuple(outputs.shape)} and "
                         f"{tuple(weights.shape)}")
    outputs, weights = outputs.contiguous(), weights.contiguous()
    check_launch_device(_combine_kernel, outputs=outputs, weights=weights)
    tokens, top_k, hidden = outputs.shape
    y = torch.empty((tokens, hidden), dtype=outputs.dtype, device=outputs.device)
    if tokens and hidden:
        _combine_kernel[(tokens, triton.cdiv(hidden, BLOCK_H))](outputs, weights, y, hidden, TOP_K=top_k,
                                                                 BLOCK_H=BLOCK_H, num_warps=4)
    return y
