"""Log every Triton JIT compile with its duration.

A compile while serving stalls the engine thread for the whole compile (hundreds of ms to seconds):
the DistServe runs showed 1-2 s TTFT stalls in the first minute of a workload whose shapes the
warm-up had not produced. With this on, each compile names the kernel and its specialization, so a
compile after the worker said it was ready is visible in its log, and the warm-up can be made to
cover it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("engine.triton_compile")
_SLOW_S = 0.05  # a disk-cache hit takes a few ms; anything slower is a real compile


def log_triton_compiles() -> bool:
    """Install the hooks (process-wide); False where triton (or its hook knobs) is missing."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    started: dict[int, float] = {}

    def before(**_: Any) -> bool:
        started[threading.get_ident()] = time.perf_counter()
        return False  # never skip the compile

    def after(**kwargs: Any) -> bool:
        seconds = time.perf_counter() - started.pop(threading.get_ident(), time.perf_counter())
        level = logging.WARNING if seconds >= _SLOW_S else logging.DEBUG
        log.log(level, "triton compiled %s in %.0f ms", str(kwargs.get("repr", "?"))[:300], seconds * 1e3)
        return False

    runtime.jit_cache_hook = before
    runtime.jit_post_compile_hook = after
    return True
