"""SwiGLU's activation on a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`silu(gate) * up` where the input is `[..., 2 * d]` laid out as `[gate | up]`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
