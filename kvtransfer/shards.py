"""The follower ranks of a tensor-parallel worker, as rank 0's KV sender and receiver see them.

A TP worker's KV cache is sharded by KV head over its ranks; each rank registers its own shard with its
own NIXL agent. The NIXL implementation lives in kvtransfer/nixl/shards.py (it calls the followers
over the TP control group); the sender and receiver only know this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState


@dataclass(frozen=True)
class ShardOutcome:
    """How one follower rank's share of a tensor-parallel WRITE ended (terminal: its handle is released)."""

    rank: int
    state: TransferState
    reason: str = ""
    checksums: tuple[int, ...] | None = None  # of its source blocks, in plan order, when asked for


class KVShards(ABC):
    """Rank 0's handle on the follower ranks of a tensor-parallel worker: each follower has its own
    NIXL agent over its own KV shard, and follower r only ever talks to the peer's rank r (homogeneous
    TP). Rank 0's sender and receiver drive them; the followers never notify anyone: rank 0 sends the
    one DONE / ABORTED notice for the whole group.

    Every call is blocking (a round trip over the TP control group) and returns only once every
    follower has finished its part; calls must come from the one thread that owns rank 0's sender and
    receiver (the KV link thread)."""

    @property
    @abstractmethod
    def infos(self) -> tuple[HandshakeInfo, ...]:
        """The followers' handshake infos, rank 1 first."""

    @abstractmethod
    def add_peer(self, peer: HandshakeInfo) -> None:
        """Follower r connects to `peer.ranks[r - 1]` (peer is the whole worker's info, checked already)."""

    @abstractmethod
    def write(self, peer: str, plan: TransferPlan, *, checksums: bool,
              fail_rank: int | None = None) -> list[ShardOutcome]:
        """Every follower WRITEs its shard of `plan`'s blocks into the peer's same rank (the peer named
        by its rank 0's agent `peer`), without notification, and waits (bounded by the plan's
        deadline) until its WRITE is terminal. `fail_rank`: fault injection, that rank's WRITE fails."""

    @abstractmethod
    def checksums(self, block_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """Every follower's block checksums of `block_ids` (receiver side verification), rank 1 first."""
