"""RMSNorm, computed in float32 and cast back exactly as Hugging Face's LlamaRMSNorm does.

The optional `residual` argument fuses the decoder's "add the residual, then normalize" into one
call (vLLM's shape). On CUDA that call is one Triton kernel (`engine/kernels/fused_norm.py`, same
rounding); elsewhere, or with `BATON_FUSED_KERNELS=0`, the torch code below is the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.dispatch import use_fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        # Uninitialised on purpose: weights always come from `load_weights`.
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`; with no residual, `(norm(x), x)`."""
        if use_fused_kernels(x) and x.dim() == 2:
            from engine.kernels.fused_norm import fused_add_rmsnorm  # imports triton: CUDA only

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF casts back before the weight multiply; doing the same keeps half-precision parity.
        return self.weight * h.to(dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Plain normalization without the residual bookkeeping (Qwen3's per-head q/k norm, `[T, H, D]`:
        one Triton kernel on CUDA, engine/kernels/head_norm.py)."""
        if use_fused_kernels(x) and x.dim() == 3:
            from engine.kernels.head_norm import rmsnorm_heads  # imports triton: CUDA only

            return rmsnorm_heads(x, self.weight, self.eps)
        return self._norm(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
