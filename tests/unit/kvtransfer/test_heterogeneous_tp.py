"""Heterogeneous TP (issue 50 part 3): the head plan, the handshake rule, and a single-rank prefill
worker's head-sliced hand-off into a two-rank decode worker, on the memory transport (and the happy
path over NIXL DRAM: one descriptor per (layer, K/V, token) row).

The decode worker's follower rank is a real agent over its own KV shard, in this process;
`_Followers` is rank 0's view of it (infos for the handshake, checksums)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.kv_integrity import head_slice_checksums
from kvtransfer.base import HandoffPayload, HandshakeInfo, LandedKV, TransferPlan, TransferState
from kvtransfer.errors import IncompatiblePeerError, TransferSetupError
from kvtransfer.faults import Fault, FaultInjector
from kvtransfer.heads import HeadSlice, head_slices
from kvtransfer.integrity import LandedVerifier, group_checksums
from kvtransfer.layout import KVLayoutInfo
from kvtransfer.memory import FABRIC, MemoryAgent
from kvtransfer.nixl.agent import NixlAgent, NixlAgentConfig
from kvtransfer.shards import KVShards, ShardOutcome
from kvtransfer.stages import ChecksumGroup
from kvtransfer.transport import Transport, TransportKind, open_transport

HEADS = 4
NUM_BLOCKS = 16


def _spec(heads: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4, dtype="float32")


def _layout(tp_size: int, tp_rank: int = 0, total_heads: int = HEADS) -> KVLayoutInfo:
    return KVLayoutInfo.from_spec(_spec(total_heads // tp_size), "test-model", tp_size=tp_size, tp_rank=tp_rank)


class _Followers(KVShards):
    """Rank 0's handle on follower agents of the same process: passive targets (decode) or ranks a
    prefill worker would drive (here only their handshake matters)."""

    def __init__(self, agents: Sequence[NixlAgent]) -> None:
        self._agents = tuple(agents)

    @property
    def infos(self) -> tuple[HandshakeInfo, ...]:
        return tuple(a.handshake_info for a in self._agents)

    def add_peer(self, peer: HandshakeInfo) -> None:
        raise AssertionError("a head-sliced pair never connects followers")

    def post(self, peer: str, plan: TransferPlan, *, checksums: bool,
             fail_rank: int | None = None) -> dict[int, ShardOutcome]:
        raise AssertionError("followers never post in these tests")

    def outcomes(self, request_id: str, attempt: int, ranks: Sequence[int]) -> dict[int, ShardOutcome] | None:
        return None

    def forget(self, request_id: str, attempt: int) -> None:
        pass

    def checksums(self, block_ids: Sequence[int], groups: Sequence[ChecksumGroup],
                  corrupt_rank: int | None = None) -> list[tuple[int, ...]]:
        return [tuple(s for g in groups if g.rank == rank for s in group_checksums(a.kv_cache, block_ids, g))
                for rank, a in enumerate(self._agents, start=1)]


@dataclass
class _Worker:
    transport: Transport
    caches: list[torch.Tensor]  # rank 0's KV shard first
    followers: tuple[NixlAgent, ...]

    def close(self) -> None:
        self.transport.close()
        for agent in self.followers:
            agent.close()


def _agent(kind: TransportKind, name: str, kv: torch.Tensor, layout: KVLayoutInfo) -> NixlAgent:
    """A follower rank's agent: a passive target, so over NIXL its progress thread keeps it progressing."""
    if kind is TransportKind.MEMORY:
        return MemoryAgent(NixlAgentConfig(name=name), kv, layout, FABRIC)
    return NixlAgent(NixlAgentConfig(name=name, progress_thread=True), kv, layout)


def _worker(role: str, tp_size: int, faults: FaultInjector | None = None, total_heads: int = HEADS,
            kind: TransportKind = TransportKind.MEMORY) -> _Worker:
    name = f"{role}-tp{tp_size}-{uuid.uuid4().hex[:8]}"
    spec = _spec(total_heads // tp_size)
    caches = [spec.allocate(NUM_BLOCKS, "cpu") for _ in range(tp_size)]
    followers = tuple(_agent(kind, f"{name}-r{r}", caches[r], _layout(tp_size, r, total_heads))
                      for r in range(1, tp_size))
    transport = open_transport(kind, name, caches[0], _layout(tp_size, 0, total_heads), faults=faults,
                               shards=_Followers(followers) if followers else None, progress_thread=True)
    return _Worker(transport, caches, followers)


@pytest.fixture(params=[TransportKind.MEMORY])
def pair(request) -> Iterator[tuple[_Worker, _Worker, FaultInjector]]:  # noqa: ANN001
    faults = FaultInjector()
    prefill, decode = _worker("prefill", 1, faults, kind=request.param), _worker("decode", 2, kind=request.param)
    torch.manual_seed(0)
    prefill.caches[0].copy_(torch.randn_like(prefill.caches[0]))
    yield prefill, decode, faults
    prefill.close()
    decode.close()


def _plan(request_id: str, local: list[int], remote: list[int], payload: HandoffPayload | None = None) -> TransferPlan:
    return TransferPlan.create(request_id, local, remote, now=time.monotonic(), timeout_s=5.0, payload=payload)


def _until_terminal(worker: _Worker, transfer) -> TransferState:  # noqa: ANN001
    give_up = time.monotonic() + 5.0
    while not transfer.state.is_terminal and time.monotonic() < give_up:
        worker.transport.sender.poll()
        time.sleep(0.001)
    return transfer.state


def _arrivals(worker: _Worker) -> list[LandedKV]:
    give_up = time.monotonic() + 5.0
    while time.monotonic() < give_up:
        landed = worker.transport.receiver.poll_arrivals()
        if landed:
            return landed
        time.sleep(0.001)
    return []


# ---- the head plan -----------------------------------------------------------------------------------
def test_a_single_rank_splits_its_heads_over_the_decode_ranks() -> None:
    assert head_slices(4, 1, 2) == (HeadSlice(0, 0, 0, 0, 2), HeadSlice(0, 1, 2, 0, 2))


def test_each_decode_rank_gathers_its_heads_from_the_prefill_ranks() -> None:
    assert head_slices(4, 4, 2) == (HeadSlice(0, 0, 0, 0, 1), HeadSlice(1, 0, 0, 1, 1),
                                    HeadSlice(2, 1, 0, 0, 1), HeadSlice(3, 1, 0, 1, 1))


def test_every_head_has_exactly_one_home_for_every_pair_of_divisors_of_eight() -> None:
    for p in (1, 2, 4, 8):
        for d in (1, 2, 4, 8):
            landed = sorted((s.dst_rank * (8 // d) + s.dst_head + k, s.src_rank * (8 // p) + s.src_head + k)
                            for s in head_slices(8, p, d) for k in range(s.num_heads))
            assert landed == [(h, h) for h in range(8)], (p, d)


def test_a_tp_size_that_does_not_divide_the_heads_has_no_plan() -> None:
    with pytest.raises(ValueError, match="destination TP size 2 does not divide the 3 KV heads"):
        head_slices(3, 1, 2)


# ---- the handshake -----------------------------------------------------------------------------------
def test_the_handshake_accepts_equal_total_heads_in_both_directions(pair) -> None:
    prefill, decode, _ = pair
    decode.transport.receiver.accept_peer(prefill.transport.handshake_info)
    assert prefill.transport.sender.add_peer(decode.transport.handshake_info)


def test_the_handshake_refuses_other_total_heads_stating_both_layouts() -> None:
    prefill, decode = _worker("prefill", 1, total_heads=3), _worker("decode", 2, total_heads=4)
    try:
        with pytest.raises(IncompatiblePeerError) as refused:
            prefill.transport.sender.add_peer(decode.transport.handshake_info)
        assert ("kv_heads: local='TP1 x 3 KV heads per rank (3 in all)' "
                "peer='TP2 x 2 KV heads per rank (4 in all)'") in str(refused.value)
    finally:
        prefill.close()
        decode.close()


def test_a_gather_from_a_multi_rank_prefill_worker_is_refused_naming_tp_size() -> None:
    prefill, decode = _worker("prefill", 2), _worker("decode", 1)
    try:
        decode.transport.receiver.accept_peer(prefill.transport.handshake_info)  # the layouts do match
        refusal = "tp_size: local=2 peer=1; head-sliced transfer: local='only from a single-rank prefill worker'"
        with pytest.raises(IncompatiblePeerError, match=refusal):
            prefill.transport.sender.add_peer(decode.transport.handshake_info)
    finally:
        prefill.close()
        decode.close()


# ---- the head-sliced hand-off --------------------------------------------------------------------------
@pytest.mark.parametrize("pair", [TransportKind.MEMORY, TransportKind.NIXL], indirect=True)
def test_each_decode_rank_receives_its_heads_of_every_block_then_one_notice(pair) -> None:
    prefill, decode, _ = pair
    peer = prefill.transport.sender.add_peer(decode.transport.handshake_info)
    decode.transport.receiver.expect("r", [5, 9], time.monotonic() + 5)
    sums = HandoffPayload(checksums=tuple(head_slice_checksums(prefill.caches[0], [1, 2], 2)))
    transfer = prefill.transport.sender.start(peer, _plan("r", [1, 2], [5, 9], sums))
    assert _until_terminal(prefill, transfer) is TransferState.DONE
    source = prefill.caches[0][[1, 2]]
    rank0, rank1 = decode.caches
    assert torch.equal(rank0[[5, 9]], source[:, :, :, :, 0:2]) and torch.equal(rank1[[5, 9]], source[:, :, :, :, 2:4])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 9)]
    assert not rank0[untouched].any() and not rank1[untouched].any()
    landed = _arrivals(decode)
    assert [(a.request_id, a.block_ids, a.payload) for a in landed] == [("r", (5, 9), sums)]
    verifier = LandedVerifier(rank0, shards=_Followers(decode.followers))
    assert verifier.problem(landed[0]) == ""  # every decode rank checks its own heads
    rank1[9, 1, 0, 2, 0, 3] += 1.0
    assert verifier.problem(landed[0]) == "checksum mismatch in 1 block(s): [rank 1 block 9]"


def test_a_failed_slice_fails_the_hand_off_and_the_decode_side_hears_it(pair) -> None:
    prefill, decode, faults = pair
    peer = prefill.transport.sender.add_peer(decode.transport.handshake_info)
    decode.transport.receiver.expect("r", [3], time.monotonic() + 5)
    faults.arm(Fault.FAIL_SHARD_TRANSFER)
    transfer = prefill.transport.sender.start(peer, _plan("r", [0], [3]))
    assert _until_terminal(prefill, transfer) is TransferState.FAILED
    assert "rank 1 failed: injected fault: fail_transfer" in transfer.reason
    failures = decode.transport.receiver.poll_failures()
    assert failures["r"].state is TransferState.FAILED and "aborted" in failures["r"].reason
    assert decode.transport.receiver.release("r") is True  # the ABORTED notice ended the danger window
    assert FABRIC.lookup(prefill.transport.handshake_info.agent_name).live_xfer_handles == 0


def test_a_cancelled_hand_off_releases_every_slice(pair) -> None:
    prefill, decode, _ = pair
    peer = prefill.transport.sender.add_peer(decode.transport.handshake_info)
    agent = FABRIC.lookup(prefill.transport.handshake_info.agent_name)
    agent.hold_writes(True)
    transfer = prefill.transport.sender.start(peer, _plan("r", [0], [3]))
    assert agent.live_xfer_handles == 2 and transfer.cancel() is TransferState.TRANSFERRING
    agent.hold_writes(False)
    assert _until_terminal(prefill, transfer).is_terminal
    prefill.transport.sender.poll()
    assert agent.live_xfer_handles == 0 and prefill.transport.sender.num_inflight == 0


def test_streaming_to_a_decode_worker_of_another_tp_size_is_refused(pair) -> None:
    prefill, decode, _ = pair
    peer = prefill.transport.sender.add_peer(decode.transport.handshake_info)
    with pytest.raises(TransferSetupError, match="another TP size"):
        prefill.transport.sender.open_stream(peer, "r", 0, time.monotonic() + 5)


def test_a_peer_rank_that_cannot_be_reached_adds_no_rank_and_removal_drops_every_rank(pair) -> None:
    prefill, decode, _ = pair
    agent = FABRIC.lookup(prefill.transport.handshake_info.agent_name)
    info = decode.transport.handshake_info
    decode.followers[0].close()  # rank 1's agent is gone from the fabric
    with pytest.raises(TransferSetupError, match="cannot add memory peer"):
        prefill.transport.sender.add_peer(info)
    assert agent.peer_names() == []
    FABRIC.register(decode.followers[0])  # back: the retried handshake adds both ranks
    peer = prefill.transport.sender.add_peer(info)
    assert agent.peer_names() == sorted([peer, info.ranks[0].agent_name])
    prefill.transport.sender.remove_peer(peer)
    assert agent.peer_names() == []
    FABRIC.unregister(info.ranks[0].agent_name)  # closed already: the fixture's close leaves it registered
