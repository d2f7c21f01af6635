"""The data of the KV hand-off between a prefill worker (sender) and a decode worker (receiver):
transfer plans and states, handshake types, what lands. The roles' interfaces are in kvtransfer/roles.py.

Split by role, like vLLM's NIXL connector: the prefill side *writes* its local blocks into the
decode side's blocks (one-sided WRITE + a notification); the decode side only *exposes* its blocks
and learns from the notification that a request's KV has arrived. Every transfer is an explicit
state machine (SGLang's lesson), polled by its owner; nothing here blocks or spawns threads.

The handshake types (`HandshakeInfo` here, the `KVLayoutInfo` it carries in kvtransfer/layout.py)
are plain frozen dataclasses: the workers carry them over gRPC (their fields live in protos/) and
hand them to `KVSender.add_peer` / `KVReceiver.accept_peer`, which refuse a peer whose layout
differs with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from engine.batch import TokenLogprobs
from kvtransfer.errors import IncompatiblePeerError, InvalidTransferPlanError
from kvtransfer.heads import head_layout_problem
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.stages import ChecksumGroup, stage_layout_problem

DEVICE_KINDS = ("cpu", "cuda")


class TransferState(Enum):
    """Where one request's KV hand-off stands. Terminal states are final and mean NIXL no longer
    touches the request's blocks on this side (for the sender: its handle has been released)."""

    PENDING = "pending"  # sender: created, not yet posted; receiver: expected, nothing arrived yet
    TRANSFERRING = "transferring"  # sender only: WRITE posted, NIXL may be reading the source blocks
    DONE = "done"  # every block landed (and its checksum matched, when checksums are on)
    FAILED = "failed"  # NIXL error, sender abort, or checksum mismatch; `reason` says which
    TIMED_OUT = "timed_out"  # the deadline passed first
    CANCELLED = "cancelled"  # the owner cancelled (request aborted)

    @property
    def is_terminal(self) -> bool:
        return self not in (TransferState.PENDING, TransferState.TRANSFERRING)


@dataclass(frozen=True)
class HandoffPayload:
    """What a DONE notice carries beside "every block landed", so that the decode side can verify and
    commit the request the moment the notice arrives, without waiting for the Prefill RPC's answer."""

    checksums: tuple[int, ...] | None = None  # per block in plan order (tensor parallel: rank-major); None: off
    first_token_id: int | None = None  # the prefill's sampled first token
    first_logprobs: TokenLogprobs | None = None
    prefill_seconds: float = 0.0  # the prefill worker's queue wait + compute for this prompt (metrics)
    # n > 1: the other choices' first tokens (token id, logprobs), sampled from the same logits, in order.
    choice_first: tuple[tuple[int, TokenLogprobs | None], ...] = ()


@dataclass(frozen=True)
class TransferPlan:
    """One request's WRITE: local block `local_block_ids[i]` goes to peer block `remote_block_ids[i]`."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    deadline: float  # on the sender's monotonic clock (seconds); past it the transfer is TIMED_OUT
    attempt: int = 0  # retries of one request use a new attempt so a late notice of an old one is ignored
    # Rides in the DONE notice. The checksums are of the local blocks, computed by the prefill engine
    # in the step that finished them (the link thread never touches the device).
    payload: HandoffPayload = field(default_factory=HandoffPayload)

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_block_ids", tuple(self.local_block_ids))
        object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        problem = _plan_problem(self)
        if problem:
            raise InvalidTransferPlanError(f"transfer plan for {self.request_id!r}: {problem}")

    @classmethod
    def create(
        cls,
        request_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        *,
        now: float,
        timeout_s: float,
        attempt: int = 0,
        payload: HandoffPayload | None = None,
    ) -> TransferPlan:
        return cls(request_id, tuple(local_block_ids), tuple(remote_block_ids), now + timeout_s, attempt,
                   payload or HandoffPayload())

    @property
    def num_blocks(self) -> int:
        return len(self.local_block_ids)

    @property
    def tag(self) -> bytes:
        """Identifies this attempt in notifications: `<request_id>#<attempt>`."""
        return f"{self.request_id}#{self.attempt}".encode()


def _plan_problem(plan: TransferPlan) -> str:
    if not plan.request_id:
        return "empty request_id"
    if plan.attempt < 0:
        return f"attempt must be >= 0, got {plan.attempt}"
    sums = plan.payload.checksums
    if sums is not None and (not sums or len(sums) % len(plan.local_block_ids)):
        return f"{len(sums)} checksums for {len(plan.local_block_ids)} blocks"
    if not plan.local_block_ids:
        return "no blocks"
    if len(plan.local_block_ids) != len(plan.remote_block_ids):
        return f"{len(plan.local_block_ids)} local vs {len(plan.remote_block_ids)} remote block ids"
    for side, ids in (("local", plan.local_block_ids), ("remote", plan.remote_block_ids)):
        if any(not isinstance(i, int) or i < 0 for i in ids):
            return f"{side} block ids must be non-negative ints"
        if len(set(ids)) != len(ids):
            return f"duplicate {side} block ids"
    return ""


@dataclass(frozen=True)
class HandshakeInfo:
    """What a worker tells a KV peer about itself (carried over gRPC, never pickled across hosts)."""

    layout: KVLayoutInfo
    agent_name: str  # unique per worker process and role (NIXL agent name)
    agent_metadata: bytes = field(repr=False)  # nixl get_agent_metadata(): connection info + registrations
    base_address: int  # address of block 0 of the registered KV tensor, in the owner's address space
    num_blocks: int
    bytes_per_block: int
    device_kind: str  # "cpu" (NIXL DRAM) | "cuda" (NIXL VRAM)
    device_id: int = 0  # CUDA device index; 0 on CPU
    # Tensor and pipeline parallelism: what a worker (its rank 0, the fields above) tells a peer also
    # lists its follower ranks 1..world_size-1 in world-rank order (stage * tp_size + tensor rank),
    # each its own agent over its own KV shard; () for one rank alone.
    ranks: tuple[HandshakeInfo, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.device_kind not in DEVICE_KINDS:
            raise ValueError(f"device_kind {self.device_kind!r} is not one of {list(DEVICE_KINDS)}")
        if not self.agent_name:
            raise ValueError("agent_name is empty")
        if self.num_blocks < 1 or self.base_address <= 0:
            raise ValueError(f"bad region: base_address={self.base_address} num_blocks={self.num_blocks}")
        if self.bytes_per_block != self.layout.bytes_per_block:
            raise ValueError(
                f"bytes_per_block {self.bytes_per_block} disagrees with "
                f"the layout's {self.layout.bytes_per_block}"
            )
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.ranks:
            self._check_ranks()

    def _check_ranks(self) -> None:
        mine = self.layout
        if mine.world_rank != 0 or len(self.ranks) != mine.world_size - 1:
            raise ValueError(f"ranks: {len(self.ranks)} follower ranks for world rank {mine.world_rank} of "
                             f"{mine.world_size} (TP{mine.tp_size} x PP{mine.pp_size}); rank 0 lists world_size - 1")
        for rank, info in enumerate(self.ranks, start=1):
            theirs = info.layout
            shape, expected = (theirs.tp_size, theirs.pp_size), (mine.tp_size, mine.pp_size)
            if info.ranks or theirs.world_rank != rank or shape != expected:
                raise ValueError(f"ranks[{rank - 1}] is world rank {theirs.world_rank} of TP{theirs.tp_size} x "
                                 f"PP{theirs.pp_size}, expected rank {rank} of TP{mine.tp_size} x PP{mine.pp_size} "
                                 "with no ranks of its own")

    @property
    def is_complete(self) -> bool:
        """Describes every rank of its worker (one rank, or rank 0 listing its followers)."""
        return len(self.ranks) == self.layout.world_size - 1

    @property
    def all_ranks(self) -> tuple[HandshakeInfo, ...]:
        """Every rank's info in world-rank order: this one (rank 0) first."""
        return (self, *self.ranks)

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device_kind == "cpu" else "VRAM"

    def compatibility_hash(self) -> str:
        return self.layout.compatibility_hash()

    def check_compatible(self, other: HandshakeInfo) -> None:
        """Raise `IncompatiblePeerError` naming every mismatching field (self = local, other = peer).

        num_blocks, addresses and device kind may differ; a DRAM<->VRAM pair is allowed (UCX moves it,
        slowly). The protocol version is compared like any other field, so an old peer is refused."""
        found = self.layout.mismatches(other.layout)
        if not found and self.bytes_per_block != other.bytes_per_block:
            found.append(("bytes_per_block", self.bytes_per_block, other.bytes_per_block))
        if found:
            raise IncompatiblePeerError(other.agent_name, found)

    def is_head_sliced(self, other: HandshakeInfo) -> bool:
        """The peer shards KV heads over another number of ranks (heterogeneous TP: kvtransfer/heads.py)."""
        return self.layout.tp_size != other.layout.tp_size

    @staticmethod
    def _check_complete(other: HandshakeInfo) -> None:
        if not other.is_complete:
            raise IncompatiblePeerError(other.agent_name, [("ranks", other.layout.world_size - 1, len(other.ranks))])

    def is_layer_sliced(self, other: HandshakeInfo) -> bool:
        """The peer splits layers over another number of stages (kvtransfer/stages.py)."""
        return self.layout.pp_size != other.layout.pp_size

    def check_group_compatible(self, other: HandshakeInfo, *, sending: bool = True) -> None:
        """`check_compatible` for whole workers: also every follower rank's layout, and the peer must
        describe all its ranks. Another TP size is accepted when both sides hold the same KV heads in
        all (`head_layout_problem`, which states both layouts when it refuses); another PP size when
        every stage of the sending side (`sending`: this one) has a route into the other's stages
        (`stage_layout_problem`). Both at once are refused."""
        if self.is_layer_sliced(other):
            self._check_complete(other)  # the routes need every rank's layers
            src, dst = (self, other) if sending else (other, self)
            found = stage_layout_problem([r.layout for r in src.all_ranks], [r.layout for r in dst.all_ranks])
            found = found if sending else [(name, mine, theirs) for name, theirs, mine in found]
            if not found and self.is_head_sliced(other):
                found = [("pp_size", self.layout.pp_size, other.layout.pp_size),
                         ("tp_size", self.layout.tp_size, other.layout.tp_size)]
            if found:
                raise IncompatiblePeerError(other.agent_name, found)
            return
        if self.is_head_sliced(other):
            found = head_layout_problem(self.layout, other.layout)
            if found:
                raise IncompatiblePeerError(other.agent_name, found)
        else:
            self.check_compatible(other)
        self._check_complete(other)
        if not self.is_head_sliced(other):
            for mine, theirs in zip(self.ranks, other.ranks, strict=False):
                mine.check_compatible(theirs)


@dataclass(frozen=True)
class LandedKV:
    """Receiver side: every block of one attempt landed (DONE notice). Not yet verified: the owner
    checks `payload.checksums` where device work is cheap (kvtransfer.integrity.LandedVerifier on the
    decode engine thread) before the blocks are used."""

    request_id: str
    attempt: int
    block_ids: tuple[int, ...]
    payload: HandoffPayload
    # Where each group of `payload.checksums` lies on this worker (the sender's stage split, known
    # from its handshake: kvtransfer/stages.py); () for one group per rank of this worker, whole blocks.
    checksum_groups: tuple[ChecksumGroup, ...] = ()


@dataclass(frozen=True)
class TransferFailure:
    """Why a request's KV did not arrive (receiver side)."""

    request_id: str
    state: TransferState  # FAILED or TIMED_OUT
    reason: str
