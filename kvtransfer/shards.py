"""The follower ranks of a tensor-parallel worker, as rank 0's KV sender and receiver see them.

A TP worker's KV cache is sharded by KV head over its ranks; each rank registers its own shard with its
own NIXL agent. The NIXL implementation lives in kvtransfer/nixl/shards.py (it calls the followers
over the TP control group); the sender and receiver only know this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.stages import ChecksumGroup


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

    `add_peer` and `checksums` are round trips over the TP control group (each waits for the engine's
    step in progress and holds the next one back for that long); `post` sends each follower its order
    without the control group, and `outcomes` is local, so a WRITE never waits for a step. Calls must come
    from the one thread that owns rank 0's sender and receiver (the KV link thread)."""

    @property
    @abstractmethod
    def infos(self) -> tuple[HandshakeInfo, ...]:
        """The followers' handshake infos, rank 1 first."""

    @abstractmethod
    def add_peer(self, peer: HandshakeInfo) -> None:
        """Follower r connects to `peer.ranks[r - 1]` (peer is the whole worker's info, checked already)."""

    @abstractmethod
    def post(self, peer: str, plan: TransferPlan, *, checksums: bool,
             fail_rank: int | None = None) -> dict[int, ShardOutcome]:
        """Order every follower to post the WRITE of its shard of `plan`'s blocks into the peer's rank
        holding them (the peer named by its rank 0's agent `peer`), without notification, and return
        at once: neither the WRITE nor its posting is waited for. Returns the ranks that could not be
        ordered (terminal, nothing posted); the others report through `outcomes`, a rank that cannot
        post its WRITE with a FAILED outcome.
        `fail_rank`: fault injection, that rank's WRITE fails."""

    @abstractmethod
    def outcomes(self, request_id: str, attempt: int, ranks: Sequence[int]) -> dict[int, ShardOutcome] | None:
        """Non-blocking: how the posted WRITEs of `ranks` ended, once every one of them is terminal
        (each follower enforces the plan's deadline on its own WRITE); None until then."""

    @abstractmethod
    def forget(self, request_id: str, attempt: int) -> None:
        """Drop what is known of a transfer given up on (its outcomes, should they still come)."""

    @abstractmethod
    def checksums(self, block_ids: Sequence[int], groups: Sequence[ChecksumGroup],
                  corrupt_rank: int | None = None) -> list[tuple[int, ...]]:
        """Receiver side verification, rank 1 first: each follower's checksums of `block_ids` for the
        `groups` on its rank, group after group (() for a rank with none). `corrupt_rank`: fault
        injection, that rank flips a byte of the first block before checksumming."""


GROUP_GRACE_S = 5.0  # past the deadline, how long followers have to report their WRITE's end


def order_followers(shards: KVShards, peer: str, plan: TransferPlan, *, checksums: bool,
                    faults: FaultInjector) -> dict[int, ShardOutcome]:
    """`shards.post`, with the FAIL_SHARD_TRANSFER fault aimed at the last follower; returns the ranks
    that ended at once (raises as `post` does)."""
    fail_rank = len(shards.infos) if faults.should_inject(Fault.FAIL_SHARD_TRANSFER) else None
    return shards.post(peer, plan, checksums=checksums, fail_rank=fail_rank)


def unreported_ranks(shards: KVShards, ended: dict[int, ShardOutcome]) -> tuple[int, ...]:
    """The followers ordered whose WRITE's end is still to come."""
    return tuple(r for r in range(1, len(shards.infos) + 1) if r not in ended)


def settled_outcomes(shards: KVShards, plan: TransferPlan, pending: Sequence[int],
                     now: float) -> dict[int, ShardOutcome] | None:
    """How the `pending` followers' WRITEs ended, once all reported; None until then. One silent
    `GROUP_GRACE_S` past the plan's deadline (it died) is FAILED, and the transfer forgotten."""
    if not pending:
        return {}
    reported = shards.outcomes(plan.request_id, plan.attempt, pending)
    if reported is None and now >= plan.deadline + GROUP_GRACE_S:
        shards.forget(plan.request_id, plan.attempt)
        reported = {r: ShardOutcome(r, TransferState.FAILED, "no report of its WRITE's end") for r in pending}
    return reported


def failure_reason(outcomes: Iterable[ShardOutcome]) -> str:
    """The failed ranks' ends, by rank ("" when every one is DONE)."""
    failed = sorted((o for o in outcomes if o.state is not TransferState.DONE), key=lambda o: o.rank)
    return "; ".join(f"rank {o.rank} {o.state.value}: {o.reason}" for o in failed)
