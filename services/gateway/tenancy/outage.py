"""`OutageLog`: one warning when a backing service (Postgres, Redis) starts failing, one when it is back.

Without it every failed request logs its own traceback (10 MB a minute under load with Redis down).
Between the two lines, failures are only counted (`failures`, and `baton_dependency_up{name}` for
dashboards). Thread-safe enough for the event loop: called from one thread.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Gauge

log = logging.getLogger(__name__)
UP = Gauge("baton_dependency_up", "1 while the gateway reaches the backing service, 0 during an outage", ["name"],
           multiprocess_mode="livemin")  # several gateway processes (replicas.py): 0 when any one is cut off


class OutageLog:
    def __init__(self, name: str) -> None:
        self.name = name
        self.down_since: float | None = None
        self.failures = 0
        UP.labels(name).set(1)

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            UP.labels(self.name).set(0)
            log.warning("%s unreachable (%s: %s); further failures are counted, not logged, until it is back",
                        self.name, type(error).__name__, error)

    def succeeded(self) -> None:
        if self.down_since is not None:
            log.warning("%s is back after %.1fs (%d failed calls meanwhile)", self.name,
                        time.monotonic() - self.down_since, self.failures)
            self.down_since, self.failures = None, 0
            UP.labels(self.name).set(1)
