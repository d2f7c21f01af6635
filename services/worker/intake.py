"""How many requests this worker has taken on: what its heartbeat reports as `requests_received`.

The scheduler reserves a placement's load on a worker until the worker's own status shows it, and the
count says when that is (scheduler/core/registry.py): a heartbeat whose count grew by n lets it drop its
n oldest reservations. So a request is counted in the same event-loop turn that makes it part of the
status, never before: a Generate flow when its first engine command is submitted (the engine runs its
commands in order, and the status snapshot is one of them), a Prefill job when it joins this worker's
jobs (the status counts jobs not yet in the engine). `WorkerServer.status` reads the count first, so a
request it counts is always in the load it reports; one that lands in between counts at the next
heartbeat (counted twice for one heartbeat, never missed).
"""

from __future__ import annotations


class Intake:
    """A count that survives role switches (the server keeps one per process)."""

    def __init__(self) -> None:
        self.count = 0

    def take(self) -> None:
        self.count += 1
