"""Which path the decoder's elementwise ops take: fused Triton kernels on CUDA, the torch reference elsewhere.

`BATON_FUSED_KERNELS=0` keeps CUDA on the torch reference ops too: the before/after switch of
`lab/micro/bench_decode.py`, and a way to bisect a numerical difference. This module never
imports triton (CPU-only installs import the layers that ask it).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

FUSED_KERNELS_ENV = "BATON_FUSED_KERNELS"


def use_fused_kernels(x: torch.Tensor) -> bool:
    """True when `x` lives on a CUDA device and the fused kernels are switched on (the default)."""
    return x.is_cuda and fused_kernels_enabled()


@functools.cache
def fused_kernels_enabled() -> bool:
    return os.environ.get(FUSED_KERNELS_ENV, "1") != "0" and importlib.util.find_spec("triton") is not None
