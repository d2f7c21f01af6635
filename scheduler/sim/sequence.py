"""A simulated request as the workers see it (`SimSequence`), its prefill work (`PrefillJob`), what a
step did (`StepOutcome`), and the engine batcher's queue order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from scheduler.sim.trace import Arrival
from scheduler.types import SLO

_T = TypeVar("_T")


@dataclass(eq=False)
class SimSequence:
    arrival: Arrival
    slo: SLO
    output_tokens: int  # after any DEGRADE cap
    max_tokens: int
    decode_worker: str
    prefill_worker: str | None
    reserved_blocks: int = 0
    decode_cached_tokens: int = 0
    decode_load_s: float = 0.0  # of those, the host-tier load time (scheduler/sim/prefix_cache.py)
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    admitted_at: float | None = None  # sent to its decode worker (a remote one: the reservation asked)
    prefill_queued_at: float | None = None  # blocks held: its prefill queued
    prefill_started_at: float | None = None  # its first prefill chunk's step began
    prefilled_at: float | None = None  # its last prefill chunk's step ended
    # When the client sees the first and the last token: through the gateway (scheduler/sim/gateway.py).
    first_token_out_at: float | None = None
    last_token_out_at: float | None = None  # its latest token's, while it streams
    finished_out_at: float | None = None
    aborted: bool = False  # its client left and the gateway aborted it (SimWorker.abort)

    @property
    def context(self) -> int:
        return self.arrival.prompt_tokens + self.generated


@dataclass(eq=False)
class PrefillJob:
    seq: SimSequence
    new_tokens: int
    cached_tokens: int
    done_tokens: int = 0  # computed so far (chunked prefill)
    load_s: float = 0.0  # host-tier blocks of the cached prefix to promote first

    @property
    def remaining(self) -> int:
        return self.new_tokens - self.done_tokens


@dataclass
class StepOutcome:
    prefilled: list[PrefillJob] = field(default_factory=list)  # remote jobs: the driver starts the transfer
    finished: list[SimSequence] = field(default_factory=list)
    first_tokens: list[SimSequence] = field(default_factory=list)  # sequences whose first token is out now
    streamed: list[SimSequence] = field(default_factory=list)  # sequences that decoded a later token


def insert_by_priority(queue: deque[_T], item: _T, outranked: Callable[[_T], bool]) -> None:
    """Insert `item` ahead of the trailing entries it outranks: the engine batcher's order (by
    `Tier.priority`, first come first served within one)."""
    i = len(queue)
    while i and outranked(queue[i - 1]):
        i -= 1
    queue.insert(i, item)


def priority(seq: SimSequence) -> int:
    return seq.arrival.tier.priority
