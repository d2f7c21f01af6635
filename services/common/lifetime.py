"""`die_with_parent`: a child process that the kernel kills when the process that started it dies.

Linux's parent-death signal (`PR_SET_PDEATHSIG`, SIGKILL): if the Python process that started the child
is killed, even by SIGKILL, the kernel kills the child, so no embedded Postgres/Redis/broker or gateway
replica outlives a crashed test run, `baton serve` or gateway supervisor. Caveat from the kernel's
rules: the signal fires when the *thread* that forked the child exits, so start children from a thread
that lives as long as they should (the main thread, in practice). The setting is applied in the child
after it has switched user (subprocess switches uid before calling `preexec_fn`), because a uid change
clears it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded in the parent: the child only makes the call


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen, called with the parent's `os.getpid()`."""

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
