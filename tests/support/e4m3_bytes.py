"""Comparing e4m3 bytes written by a Triton kernel under the CPU interpreter with torch's.

Triton 3.9's interpreter rounds float32 -> e4m3 differently from torch and the GPU in two known ways: where
the rounding carries into the next binade (torch and the GPU give 32.0) it drops the carry and gives half
of it (16.0), and an exact tie may go to the odd neighbour. Only those patterns are forgiven, on a small
share of the values (ties are common where bf16 values are divided by a scale from a bf16 absmax);
tests/gpu asks the compiled kernels for bit-identity."""

from __future__ import annotations

import torch

E4M3_MANTISSA_BITS = 3


def same_bytes_but_for_interpreter_rounding(out: torch.Tensor, ref: torch.Tensor, max_share: float = 0.02) -> bool:
    differ = out.view(torch.uint8) != ref.view(torch.uint8)
    got, want = out.float()[differ], ref.float()[differ]
    power_of_two = torch.frexp(want).mantissa.abs() == 0.5
    dropped_carry = power_of_two & (got == want / 2)
    # One step of e4m3 at the larger magnitude of the two (a neighbour, as a tie rounded the other way gives).
    step = torch.ldexp(torch.ones_like(want), torch.frexp(torch.maximum(got.abs(), want.abs())).exponent
                       - 1 - E4M3_MANTISSA_BITS)
    neighbour = (got - want).abs() <= step
    return bool((dropped_carry | neighbour).all()) and differ.float().mean().item() < max_share
