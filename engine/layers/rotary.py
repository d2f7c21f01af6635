"""Rotary position embeddings (rotate-half convention of HF Llama) with Llama-3 or YaRN frequency scaling.

cos/sin are precomputed for every position up to `max_position` and indexed by the step's
`positions` tensor, so a step with tokens of many sequences at different offsets (continuous
batching, chunked prefill) needs one gather and no per-sequence work.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeScaling, YarnScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` in float32, the same arithmetic as transformers'."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if isinstance(scaling, YarnScaling):
        return _yarn_scale(inv_freq, head_dim, theta, scaling)
    return inv_freq if scaling is None else _llama3_scale(inv_freq, scaling)


def _yarn_scale(inv_freq: torch.Tensor, dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """`_compute_yarn_parameters`: frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those turning more than `beta_fast` times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv_freq / s.factor) * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """`_compute_llama3_parameters`: keep high frequencies, divide low ones by `factor`, blend between."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # [max_position, head_dim // 2] float32
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: RopeScaling | YarnScaling | None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # YaRN scales cos and sin themselves (HF's `attention_scaling`), so q.k grows by its square.
        magnitude = scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0
        # Half-width tables: the two halves of HF's cat((freqs, freqs)) are identical. Kept in float32
        # and not saved in state_dict (derived from the config, never loaded).
        self.register_buffer("cos_cache", freqs.cos() * magnitude, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * magnitude, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions [T]`, shaped `[T, 1, head_dim // 2]` to broadcast over heads.

        Cast to the activation dtype before use, as HF does, so half-precision results match it.
        """
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, H, D]` by half-width `cos/sin [T, 1, D/2]`: `x * cos + rotate_half(x) * sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
