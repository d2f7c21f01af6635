"""Worker fault injection: kvtransfer's faults plus worker-level ones, armed over the InjectFault RPC.

The InjectFault RPC is refused unless the worker runs with --allow-fault-injection (tests, chaos
runs). Faults drive the real code paths: a delayed prefill looks like a slow prefill worker to the
decode side, a stalled WRITE times out through the sender's own deadline, and so on.
"""

from __future__ import annotations

import threading
from collections import deque

from kvtransfer.faults import Fault, FaultConfig, FaultInjector

DELAY_PREFILL = "delay_prefill"  # prefill worker: hold the next prefill back for `delay_s` (abortable)
FAULT_NAMES = (*(f.value for f in Fault), DELAY_PREFILL)


class WorkerFaults:
    def __init__(self, config: FaultConfig | None = None) -> None:
        self.kv = FaultInjector(config)  # consulted by the NIXL sender and receiver
        self._delays: deque[float] = deque()
        self._lock = threading.Lock()

    def arm(self, name: str, times: int = 1, delay_s: float = 0.0) -> None:
        """Inject `name` at its next `times` opportunities. Raises ValueError naming the valid faults."""
        times = max(times, 1)
        if name == DELAY_PREFILL:
            if delay_s <= 0:
                raise ValueError("delay_prefill needs delay_s > 0")
            with self._lock:
                self._delays.extend([delay_s] * times)
            return
        try:
            fault = Fault(name)
        except ValueError:
            raise ValueError(f"unknown fault {name!r}; valid: {', '.join(FAULT_NAMES)}") from None
        self.kv.arm(fault, times)

    def take_prefill_delay(self) -> float:
        """Seconds to hold the next prefill back (0: none armed)."""
        with self._lock:
            return self._delays.popleft() if self._delays else 0.0
