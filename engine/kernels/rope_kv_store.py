"""RoPE on q and k fused with the KV store: one program per new token reads its q, k and v once,
rotates q and k, writes q to a new tensor and k, v into the token's slot of the paged cache.

Replaces the reference's ~20 torch kernels per layer (`apply_rotary` on q and k, then `store_kv`).
Rounding follows the reference on the activation dtype (HF's rotate-half): `x1 * cos` and `x2 * sin`
are each rounded, then their difference (or sum); compiled, the float32 products still differ from
torch's in a last bit for some elements (tests/gpu/test_fused_kernels.py bounds the error against
float32 instead of asking for bit-identity). cos/sin come in already gathered per token and
cast to the activation dtype (`RotaryEmbedding.forward`). A negative slot skips the cache write (a
padded CUDA-graph row) but its q is still rotated. Cache layout and checks: `engine/kernels/kv_store.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.kv_store import check_activation_dtype, check_launch_device, fp8_saturate, kv_layer_view


@triton.jit
def _rotate(x1, x2, c, s, like_ptr):
    """Rotate-half with the reference's per-op rounding to the element type of `like_ptr` (the
    activation dtype); returns both halves in that type."""
    dtype = like_ptr.dtype.element_ty
    # Round to nearest even, as torch does: Triton's default fp32 -> bf16 downcast is not pinned.
    a = (x1 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) \
        - (x2 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b = (x2 * c).to(dtype, fp_downcast_rounding="rtne").to(tl.float32) \
        + (x1 * s).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    return a.to(dtype, fp_downcast_rounding="rtne"), b.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _rope_kv_store_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, H, D] views, head_dim contiguous
    cos_ptr, sin_ptr,  # [T, D/2] rows of stride stride_cos
    q_out_ptr,  # [T, H_q, D] contiguous
    cache_ptr,  # one layer's view [num_blocks, 2, block_size, H_kv, D] (see kv_store.py)
    slot_ptr,  # [T] int64, < 0 = no cache write
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    block_size, num_q_heads, num_kv_heads, half,
    k_scale, v_scale,  # FP8 cache only: stored = x / scale
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QUANTIZE: tl.constexpr,  # the cache is FP8 (see kv_store.py)
):
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < half
    c = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = (hq < num_q_heads) & d_ok[None, :]
    q = q_ptr + tok * stride_qt + hq * stride_qh + offs_d[None, :]
    q1, q2 = _rotate(tl.load(q, mask=q_mask, other=0.0).to(tl.float32),
                     tl.load(q + half, mask=q_mask, other=0.0).to(tl.float32), c, s, q_out_ptr)
    q_dst = q_out_ptr + tok * num_q_heads * 2 * half + hq * 2 * half + offs_d[None, :]
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + half, q2, mask=q_mask)

    slot = tl.load(slot_ptr + tok)
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    # A skipped row stores nothing; its address is computed from slot 0 (as in kv_store.py, the row
    # test is folded into the head limit as an integer for the interpreter's sake).
    kv_mask = (hk < tl.where(slot >= 0, num_kv_heads, 0)) & d_ok[None, :]
    slot = tl.maximum(slot, 0)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + hk * stride_ch \
        + offs_d[None, :]
    k = k_ptr + tok * stride_kt + hk * stride_kh + offs_d[None, :]
    k1, k2 = _rotate(tl.load(k, mask=kv_mask, other=0.0).to(tl.float32),
                     tl.load(k + half, mask=kv_mask, other=0.0).to(tl.float32), c, s, q_out_ptr)
    v = v_ptr + tok * stride_vt + hk * stride_vh + offs_d[None, :]
    v1, v2 = tl.load(v, mask=kv_mask), tl.load(v + half, mask=kv_mask)
    if QUANTIZE:
        k1, k2 = fp8_saturate(k1, k_scale), fp8_saturate(k2, k_scale)
        v1, v2 = fp8_saturate(v1, v_scale), fp8_saturate(v2, v_scale)
    tl.store(dst, k1.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + half, k2.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + stride_ckv, v1.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + stride_ckv + half, v2.to(cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_and_store_kv(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
    layer: int,
    query: torch.Tensor,  # [T, H_q, D]
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    cos: torch.Tensor,  # [T, 1, D/2] (or [T, D/2]), the activation dtype
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    k_scale: float = 1.0,  # FP8 cache only: the layer's K and V dequantization scales
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Rotate q and k, store rotated k and v at their slots of layer `layer`; return the rotated q. An FP8
    cache gets the rotated k (rounded to the activation dtype first, as the reference does) over k_scale."""
    cache = kv_layer_view(kv_cache, layer)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    tokens, num_q_heads = query.shape[0], query.shape[1]
    _check_shapes(query, key, value, cos, sin, slot_mapping, num_kv_heads, head_dim)
    check_activation_dtype("key", key.dtype, kv_cache.dtype)
    check_launch_device(_rope_kv_store_kernel, kv_cache=kv_cache, query=query, key=key, value=value, cos=cos,
                        sin=sin, slot_mapping=slot_mapping)
    cos, sin = cos.reshape(tokens, head_dim // 2), sin.reshape(tokens, head_dim // 2)
    q_out = torch.empty((tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return q_out
    _rope_kv_store_kernel[(tokens,)](
        query, key, value, cos, sin, q_out, cache, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_size, num_q_heads, num_kv_heads, head_dim // 2, k_scale, v_scale,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), QUANTIZE=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )
    return q_out


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, slot_mapping: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    tokens = query.shape[0]
    if query.dim() != 3 or query.shape[2] != head_dim or query.stride(-1) != 1:
        raise ValueError(f"query must be [T, H_q, {head_dim}] with contiguous head_dim, got {tuple(query.shape)}")
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (tokens, num_kv_heads, head_dim) or t.stride(-1) != 1 or t.dtype != query.dtype:
            raise ValueError(f"{name} must be [{tokens}, {num_kv_heads}, {head_dim}] {query.dtype} with contiguous "
                             f"head_dim, got {tuple(t.shape)} {t.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != tokens * head_dim // 2 or t.shape[0] != tokens or t.dtype != query.dtype:
            raise ValueError(f"{name} must be [{tokens}, 1, {head_dim // 2}] {query.dtype}, got {tuple(t.shape)} "
                             f"{t.dtype}")
    if tuple(slot_mapping.shape) != (tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be [{tokens}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
