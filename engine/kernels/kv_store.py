"""KV store: scatter a step's new K/V rows into one layer of the block-major paged cache.

The cache is `kv_cache[num_blocks, num_layers, 2, block_size, H_kv, D]` (engine/kv_cache.py); a token's
slot is `block_id * block_size + offset`. One program per new token copies that token's K and V for
every KV head ([H_kv, D] each) into its slot. A negative slot means "skip": the model runner pads a
CUDA-graph batch with such rows, and they must not touch any block. An FP8 cache (`float8_e4m3fn`)
stores `x / scale` (the layer's K or V scale) saturated to +-448: a plain cast would turn an outlier into NaN.

This module also owns the checks every paged-attention wrapper runs on the cache (`kv_layer_view`),
so that the decode and prefill wrappers agree on what a valid cache is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.errors import ConfigError

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_HEAD_DIM = 16  # tl.dot needs an inner dimension of at least 16
MAX_HEAD_DIM = 256  # beyond this one K tile no longer fits the register budget of a program


@triton.jit
def _kv_store_kernel(
    key_ptr,  # [T, H_kv, D]   strides (stride_kt, stride_kh, 1)
    value_ptr,  # [T, H_kv, D] strides (stride_vt, stride_vh, 1)
    cache_ptr,  # [num_blocks, 2, block_size, H_kv, D] one layer's view; strides (stride_cb, stride_ckv,
    #             stride_cs, stride_ch, 1); element [b, 0] is K, [b, 1] is V
    slot_ptr,  # [T] int64, slot = block_id * block_size + offset; < 0 = skip the row
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    k_scale,  # FP8 cache only: stored = k / k_scale
    v_scale,
    BLOCK_H: tl.constexpr,  # next power of two >= H_kv
    BLOCK_D: tl.constexpr,  # next power of two >= D
    QUANTIZE: tl.constexpr,  # the cache is FP8: scale and saturate before the cast
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A skipped row (slot < 0) stores no head; its address is computed from slot 0, never accessed.
    # (The limit folds the row test in as an integer: triton 3.9's interpreter turns a scalar boolean
    # broadcast into a tensor mask into int32, which its loads and stores reject.)
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)
    slot = tl.maximum(slot, 0)
    block_id = slot // block_size
    within = slot % block_size
    dst = cache_ptr + block_id * stride_cb + within * stride_cs
    dst_hd = offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANTIZE:
        k = fp8_saturate(k, k_scale)
        v = fp8_saturate(v, v_scale)
    tl.store(dst + dst_hd, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv + dst_hd, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_saturate(x, scale):
    """`x / scale` in float32, clamped to e4m3's finite range (the caller casts)."""
    return tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)


def kv_layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """Validate the paged cache and return layer `layer` as [num_blocks, 2, block_size, H_kv, D].

    The view shares storage with the cache (its data pointer includes the layer offset), so kernels
    index it with the whole cache's block stride: every block stays one contiguous region.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"kv_cache dtype {kv_cache.dtype} unsupported; valid: {SUPPORTED_DTYPES}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache head_dim must be contiguous, got strides {kv_cache.stride()}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for a cache of {kv_cache.shape[1]} layers")
    head_dim = kv_cache.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ConfigError(f"head_dim {head_dim} unsupported; valid: {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    return kv_cache[:, layer]


def check_activation_dtype(name: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Activations meet the cache in its own dtype, or in any float dtype over an FP8 cache."""
    if dtype == cache_dtype or (cache_dtype == torch.float8_e4m3fn and dtype in _ACTIVATION_DTYPES):
        return
    raise ValueError(f"{name} dtype {dtype} cannot use a {cache_dtype} kv_cache (same dtype, or any float over fp8)")


def is_interpreted(kernel: object) -> bool:
    """True when triton runs `kernel` in its CPU interpreter (TRITON_INTERPRET=1 before triton's import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launch_device(kernel: object, **tensors: torch.Tensor) -> None:
    """Every tensor of one launch must live on one device: CUDA, or any device under the interpreter."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"tensors must share one device, got {devices}")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"triton kernels need CUDA tensors, got {device}; on CPU use the torch backend "
            "(or set TRITON_INTERPRET=1 before importing triton, for tests)"
        )


def store_kv(
    kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, H_kv, D]
    layer: int,
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, negative = skip
    k_scale: float = 1.0,  # FP8 cache only: the layer's K and V dequantization scales
    v_scale: float = 1.0,
) -> None:
    """Write `key[t]`/`value[t]` into slot `slot_mapping[t]` of layer `layer`, in place.

    Slots must be distinct among the non-negative ones (two rows aimed at one slot race). Slots are
    not range-checked on the device (that would need a sync); the block manager guarantees them.
    """
    cache = kv_layer_view(kv_cache, layer)
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [T, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        check_activation_dtype(name, t.dtype, kv_cache.dtype)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} head_dim must be contiguous, got strides {t.stride()}")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(
            f"key, value and slot_mapping must agree on T: {key.shape[0]}, {value.shape[0]}, "
            f"{tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    check_launch_device(_kv_store_kernel, kv_cache=kv_cache, key=key, value=value, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _kv_store_kernel[(num_tokens,)](
        key, value, cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_size, num_kv_heads, head_dim, k_scale, v_scale,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZE=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
