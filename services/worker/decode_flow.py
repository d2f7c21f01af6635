"""One generate request's life on a decode worker: its choices' engine request ids per attempt, which choices
were aborted, its output queue and the task driving it (services/worker/decode_service.py runs it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.worker.decode_jobs import GenerateEvent, GenerateJob


@dataclass
class DecodeFlow:
    job: GenerateJob
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # every choice aborted
    events: asyncio.Queue[GenerateEvent | BaseException | None] = field(default_factory=asyncio.Queue)
    engine_rids: tuple[str, ...] = ()  # per choice, of the latest attempt; [0] holds a remote reservation
    choice_aborted: list[bool] = field(default_factory=list)
    in_engine: bool = False
    attempts: int = 0
    peer_address: str = ""  # the prefill worker of the latest remote attempt
    task: asyncio.Task[None] | None = None
    counted: bool = False  # in the worker's intake (`DecodeService._taken`)

    def __post_init__(self) -> None:
        self.choice_aborted = [False] * len(self.job.choice_ids)

    @property
    def engine_rid(self) -> str:
        return self.engine_rids[0]

    def next_engine_rid(self) -> str:
        self.engine_rids = tuple(f"{rid}@{self.attempts}" for rid in self.job.choice_ids)
        self.attempts += 1
        return self.engine_rid

    def live(self) -> list[int]:
        return [i for i, aborted in enumerate(self.choice_aborted) if not aborted]
