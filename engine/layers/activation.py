"""SwiGLU's activation on a merged gate/up projection: one Triton kernel on CUDA
(`engine/kernels/silu_mul.py`), the torch reference elsewhere or with `BATON_FUSED_KERNELS=0`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import use_fused_kernels


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is `[..., 2 * d]` laid out as `[gate | up]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`[..., 2d] -> [..., d]`: the fused kernel on CUDA, the torch reference elsewhere."""
    if use_fused_kernels(x) and x.dim() == 2:
        from engine.kernels.silu_mul import silu_and_mul as fused  # imports triton: CUDA only

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
