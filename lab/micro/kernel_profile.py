"""Device time per kernel of a step, from torch's profiler: where a step's time goes.

`kernel_rows(fn, label)` runs `fn` `repeats` times under the profiler and
returns the kernels by total device time, largest first: name (cut to 80 characters), calls per
run, µs per run and share of the summed kernel time. Kernel times do not include the gaps between
launches: the sum over kernels against the step's wall time says how much of a step is launch-bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_rows(fn: Callable[[], object], label: str, repeats: int = 5, top: int = 25) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: compile and allocate outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # kernels: CUDA-typed events
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total_us = sum(e.device_time_total for e in kernels) or 1.0
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    rows = [{"case": "kernel", "profile": label, "kernel": e.key[:80], "calls": e.count / repeats,
             "us": e.device_time_total / repeats, "share": e.device_time_total / total_us} for e in kernels[:top]]
    rows.append({"case": "kernel", "profile": label, "kernel": "(all kernels)",
                 "calls": sum(e.count for e in kernels) / repeats, "us": total_us / repeats, "share": 1.0})
    return rows


def print_kernel_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['profile']:>14}  {row['us']:>9.1f} us  {row['share']:>6.1%}  "
              f"x{row['calls']:<6.0f} {row['kernel']}")
