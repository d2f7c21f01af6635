"""Fault injection for KV transfers: real code paths, switched on by config or armed by tests.

A `FaultInjector` is consulted at fixed points of the NIXL sender and receiver; each fault drives the
same state transitions a real failure would (handles released, abort notices sent, quarantine). The
worker failure tests arm one-shot faults; a chaos run sets rates with a seed (deterministic).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from enum import Enum

import torch


class Fault(Enum):
    FAIL_TRANSFER = "fail_transfer"  # sender: the next WRITE reports a NIXL error -> FAILED
    STALL_TRANSFER = "stall_transfer"  # sender: the next WRITE is never posted -> TIMED_OUT at its deadline
    CORRUPT_DESTINATION = "corrupt_destination"  # receiver: flip a byte of the first block after arrival
    DROP_NOTIFICATION = "drop_notification"  # receiver: lose the next DONE notice -> TIMED_OUT, quarantine
    # sender with tensor parallelism: the last follower rank's next WRITE reports a NIXL error -> the
    # whole transfer FAILED (rank 0 decides; the follower takes its real failure path)
    FAIL_SHARD_TRANSFER = "fail_shard_transfer"
    # receiver with follower ranks (tensor or pipeline parallel): the last follower rank flips a byte of
    # the first block before it checksums its blocks -> checksum mismatch on that rank
    CORRUPT_SHARD_DESTINATION = "corrupt_shard_destination"


@dataclass(frozen=True)
class FaultConfig:
    """Per-transfer probabilities of each fault (0 = never), and the RNG seed."""

    fail_transfer_rate: float = 0.0
    stall_transfer_rate: float = 0.0
    corrupt_destination_rate: float = 0.0
    drop_notification_rate: float = 0.0
    fail_shard_transfer_rate: float = 0.0
    corrupt_shard_destination_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for fault in Fault:
            rate = self.rate(fault)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{fault.value}_rate must be in [0, 1], got {rate}")

    def rate(self, fault: Fault) -> float:
        return float(getattr(self, f"{fault.value}_rate"))


class FaultInjector:
    """Decides, at each injection point, whether to inject a fault. Thread-safe (tests arm it from
    another thread than the one polling transfers)."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self._config = config or FaultConfig()
        self._rng = random.Random(self._config.seed)
        self._armed: dict[Fault, int] = {}
        self._injected: dict[Fault, int] = {f: 0 for f in Fault}
        self._lock = threading.Lock()

    def arm(self, fault: Fault, times: int = 1) -> None:
        """Inject `fault` at its next `times` opportunities, whatever the configured rate."""
        with self._lock:
            self._armed[fault] = self._armed.get(fault, 0) + times

    def should_inject(self, fault: Fault) -> bool:
        """Consume one armed shot of `fault`, else draw against its configured rate."""
        with self._lock:
            if self._armed.get(fault, 0) > 0:
                self._armed[fault] -= 1
                hit = True
            else:
                rate = self._config.rate(fault)
                hit = rate > 0.0 and self._rng.random() < rate
            if hit:
                self._injected[fault] += 1
            return hit

    def injected(self, fault: Fault) -> int:
        with self._lock:
            return self._injected[fault]


def corrupt_block_byte(kv_cache: torch.Tensor, block_id: int, byte_offset: int | None = None) -> None:
    """Flip every bit of one byte of block `block_id` in place (middle of the block by default)."""
    raw = kv_cache[block_id].reshape(-1).view(torch.uint8)
    offset = raw.numel() // 2 if byte_offset is None else byte_offset
    raw[offset] = raw[offset] ^ 0xFF
