"""The data of the KV hand-off between a prefill worker (sender) and a decode worker (receiver):
transfer plans and states, handshake types, what lands. The roles' interfaces are in kvtransfer/roles.py.

Split by role, like vLLM's NIXL connector: the prefill side *writes* its local blocks into the
decode side's blocks (one-sided WRITE + a notification); the decode side only *exposes* its blocks
and learns from the notification that a request's KV has arrived. Every transfer is an explicit
state machine (SGLang's lesson), polled by its owner; nothing here blocks or spawns threads.

The handshake types (`KVLayoutInfo`, `HandshakeInfo`) are plain frozen dataclasses: the workers
carry them over gRPC (their fields live in protos/) and hand them to `KVSender.add_peer` /
`KVReceiver.accept_peer`, which refuse a peer whose layout differs with a message naming the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum

from engine.batch import TokenLogprobs
from engine.kv_cache import _DTYPE_BYTES as KV_DTYPE_BYTES  # TODO: engine to export it publicly
from engine.kv_cache import KVCacheSpec
from kvtransfer.errors import IncompatiblePeerError, InvalidTransferPlanError

# Bump when the notification format, the handshake fields or the layout meaning change.
# 2: the DONE notice carries the first token; checksums are computed by the engines, not the link.
KV_PROTOCOL_VERSION = 2
# engine.kv_cache's layout: kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
BLOCK_MAJOR_LAYOUT = "block_major_v1"
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
class KVLayoutInfo:
    """Everything two workers must agree on before one writes into the other's blocks."""

    protocol_version: int
    model_id: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int  # homogeneous TP only: prefill rank r writes into decode rank r

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(KV_DTYPE_BYTES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, {self.tp_size})")

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str, tp_size: int = 1, tp_rank: int = 0) -> KVLayoutInfo:
        return cls(
            protocol_version=KV_PROTOCOL_VERSION,
            model_id=model_id,
            dtype=spec.dtype,
            layout=BLOCK_MAJOR_LAYOUT,
            block_size=spec.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )

    def to_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        return self.to_spec().bytes_per_block

    def compatibility_hash(self) -> str:
        """Stable 16-hex-digit hash of every field; equal hashes mean the peers may exchange blocks."""
        items = sorted((f.name, getattr(self, f.name)) for f in fields(self))
        return hashlib.sha256(repr(items).encode()).hexdigest()[:16]

    def mismatches(self, other: KVLayoutInfo) -> list[tuple[str, object, object]]:
        """(field, mine, theirs) for every field that differs, in declaration order."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


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
    # Tensor parallelism: what a worker (its rank 0, the fields above) tells a peer also lists its
    # follower ranks 1..tp_size-1, each its own agent over its own KV shard; () for one rank alone.
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
        if self.layout.tp_rank != 0 or len(self.ranks) != self.layout.tp_size - 1:
            raise ValueError(f"ranks: {len(self.ranks)} follower ranks for tp_rank {self.layout.tp_rank} of "
                             f"tp_size {self.layout.tp_size}; rank 0 lists tp_size - 1")
        for rank, info in enumerate(self.ranks, start=1):
            if info.ranks or info.layout.tp_rank != rank or info.layout.tp_size != self.layout.tp_size:
                raise ValueError(f"ranks[{rank - 1}] is tp_rank {info.layout.tp_rank} of {info.layout.tp_size}, "
                                 f"expected rank {rank} of {self.layout.tp_size} with no ranks of its own")

    @property
    def is_complete(self) -> bool:
        """Describes every rank of its worker (tp_size 1, or rank 0 listing its followers)."""
        return len(self.ranks) == self.layout.tp_size - 1

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

    def check_group_compatible(self, other: HandshakeInfo) -> None:
        """`check_compatible` for whole workers: also every follower rank's layout, and the peer must
        describe all its ranks (tp_size is compared first, so a TP-size mismatch names tp_size)."""
        self.check_compatible(other)
        if not other.is_complete:
            raise IncompatiblePeerError(other.agent_name, [("ranks", self.layout.tp_size - 1, len(other.ranks))])
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


@dataclass(frozen=True)
class TransferFailure:
    """Why a request's KV did not arrive (receiver side)."""

    request_id: str
    state: TransferState  # FAILED or TIMED_OUT
    reason: str
