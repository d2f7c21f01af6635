"""Per-rank KV transfer with tensor parallelism, in one process: rank 0's NIXL sender and receiver
drive real `ShardAgent`s (rank 1 of a prefill and of a decode worker, each its own NIXL agent and
polling thread); `FollowerShards` reaches them through a direct call instead of the TP control group.
A follower only posts inside that call; its WRITE's end comes back over rank 0's outcome socket.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support.required import require_module

require_module("nixl._api")  # the KV hand-off: a missing nixl is an ERROR, never a skip

sys.path.insert(0, str(Path(__file__).parent))
from nixl_pair_helpers import LAYOUT, SPEC, ManualClock, drive, random_plan  # noqa: E402

from kvtransfer.base import HandshakeInfo, TransferPlan, TransferState  # noqa: E402
from kvtransfer.faults import Fault, FaultInjector, corrupt_block_byte  # noqa: E402
from kvtransfer.integrity import LandedVerifier  # noqa: E402
from kvtransfer.nixl import NixlAgent, NixlAgentConfig, NixlKVReceiver, NixlKVSender, ReceiverConfig  # noqa: E402
from kvtransfer.nixl.shards import (  # noqa: E402
    ChecksumsRequest,
    FollowerShards,
    HandshakeInfoRequest,
    OrderInboxRequest,
    ShardAgent,
)
from kvtransfer.shards import KVShards, ShardOutcome  # noqa: E402

NUM_BLOCKS = 32
RANK0, RANK1 = replace(LAYOUT, tp_size=2, tp_rank=0), replace(LAYOUT, tp_size=2, tp_rank=1)


def _kv(seed: int | None) -> torch.Tensor:
    kv = SPEC.allocate(NUM_BLOCKS, "cpu")
    if seed is not None:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def _direct(agent: ShardAgent, before: dict[type, object] | None = None):  # noqa: ANN202
    """call_followers for one in-process follower; `before[type(request)]()` runs first (fault hooks)."""
    def call(request: object) -> list[object]:
        hook = (before or {}).get(type(request))
        if hook is not None:
            hook()  # type: ignore[operator]
        return [agent.handle(request)]
    return call


class Workers:
    """A prefill and a decode worker of 2 ranks each."""

    def __init__(self, faults: FaultInjector) -> None:
        tag = uuid.uuid4().hex[:6]
        self.prefill_kv = (_kv(1), _kv(2))
        self.decode_kv = (_kv(None), _kv(None))
        self.prefill0 = NixlAgent(NixlAgentConfig(name=f"prefill-{tag}"), self.prefill_kv[0], RANK0)
        self.decode0 = NixlAgent(NixlAgentConfig(name=f"decode-{tag}"), self.decode_kv[0], RANK0)
        self.prefill1 = ShardAgent(f"prefill-{tag}-tp1", self.prefill_kv[1], RANK1, 1e-3, 5e-5)
        self.decode1 = ShardAgent(f"decode-{tag}-tp1", self.decode_kv[1], RANK1, 1e-3, 5e-5)
        self.decode_hooks: dict[type, object] = {}
        self.sender = NixlKVSender(self.prefill0, faults=faults,
                                   shards=FollowerShards(_direct(self.prefill1)))
        self.receiver = NixlKVReceiver(self.decode0, ReceiverConfig(quarantine_s=60.0), faults,
                                       shards=FollowerShards(_direct(self.decode1, self.decode_hooks)))
        self.peer = self.sender.add_peer(self.receiver.handshake_info)
        self.receiver.accept_peer(self.sender.handshake_info)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        for agent in (self.prefill1, self.decode1, self.prefill0, self.decode0):
            agent.close()


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture
def workers(faults):
    pair = Workers(faults)
    yield pair
    pair.close()


def _plan(request_id: str, checksums_of: torch.Tensor | None = None) -> TransferPlan:
    return random_plan(request_id, NUM_BLOCKS, checksums_of)


def _verifier(workers: Workers) -> LandedVerifier:
    return LandedVerifier(workers.decode_kv[0], shards=FollowerShards(_direct(workers.decode1, workers.decode_hooks)))


def _start(workers: Workers, plan: TransferPlan):  # noqa: ANN202
    workers.receiver.expect(plan.request_id, plan.remote_block_ids, deadline=time.monotonic() + 10.0)
    transfer = workers.sender.start(workers.peer, plan)
    return transfer, *drive(workers.sender, workers.receiver, [transfer])


def test_the_handshake_lists_the_follower_ranks_agents(workers) -> None:
    info = workers.sender.handshake_info
    assert [(r.agent_name, r.layout.tp_rank) for r in info.ranks] == [(workers.prefill1.handshake_info().agent_name, 1)]
    assert info.ranks[0].base_address == workers.prefill_kv[1].data_ptr()


def test_every_rank_lands_its_shard_before_the_one_notice(workers) -> None:
    plan = _plan("req-tp", workers.prefill_kv[0])
    transfer, arrived, failures = _start(workers, plan)
    assert transfer.state is TransferState.DONE and set(arrived) == {"req-tp"} and not failures
    assert _verifier(workers).problem(arrived["req-tp"]) == ""  # the notice's checksums cover both ranks
    for rank in (0, 1):
        sent = workers.prefill_kv[rank][list(plan.local_block_ids)]
        assert torch.equal(workers.decode_kv[rank][list(plan.remote_block_ids)], sent)


def test_a_failed_follower_write_fails_the_whole_transfer(workers, faults) -> None:
    faults.arm(Fault.FAIL_SHARD_TRANSFER)
    transfer, arrived, failures = _start(workers, _plan("req-fail"))
    assert transfer.state is TransferState.FAILED and not arrived
    assert transfer.reason == "rank 1 failed: injected fault: fail_transfer"
    assert "aborted: rank 1 failed" in failures["req-fail"].reason


def test_a_corrupted_follower_block_fails_the_checksum(workers) -> None:
    plan = _plan("req-corrupt", workers.prefill_kv[0])
    bad = plan.remote_block_ids[2]
    workers.decode_hooks[ChecksumsRequest] = lambda: corrupt_block_byte(workers.decode_kv[1], bad)
    transfer, arrived, failures = _start(workers, plan)
    assert transfer.state is TransferState.DONE and not failures
    problem = _verifier(workers).problem(arrived["req-corrupt"])
    assert problem == f"checksum mismatch in 1 block(s): [rank 1 block {bad}]"


def test_a_follower_gets_its_order_without_the_control_group_and_reports_its_end_later(workers) -> None:
    """The control group waits for the engine's step in progress (seconds under load), during which the
    plan's deadline runs: an order over it reached the follower with its deadline spent."""
    plan = _plan("req-post")
    called: list[type] = []
    direct = _direct(workers.prefill1)
    shards = FollowerShards(lambda request: called.append(type(request)) or direct(request))
    workers.receiver.expect(plan.request_id, plan.remote_block_ids, deadline=time.monotonic() + 10.0)
    assert shards.post(workers.peer, plan, checksums=True) == {}  # ordered, not waited for: no outcome yet
    assert called == [HandshakeInfoRequest, OrderInboxRequest]  # set-up only: the order itself went by socket
    give_up = time.monotonic() + 10.0
    while (ends := shards.outcomes("req-post", 0, [1])) is None and time.monotonic() < give_up:
        time.sleep(0.001)
    assert ends is not None and ends[1].state is TransferState.DONE and ends[1].checksums is not None
    sent = workers.prefill_kv[1][list(plan.local_block_ids)]
    assert torch.equal(workers.decode_kv[1][list(plan.remote_block_ids)], sent)


class _SilentFollower(KVShards):
    """A follower rank that posted its WRITE and then died: it never reports the end."""

    def __init__(self, info: HandshakeInfo) -> None:
        self._info = info

    @property
    def infos(self) -> tuple[HandshakeInfo, ...]:
        return (self._info,)

    def add_peer(self, peer: HandshakeInfo) -> None:
        return None

    def post(self, peer: str, plan: TransferPlan, *, checksums: bool,
             fail_rank: int | None = None) -> dict[int, ShardOutcome]:
        return {}

    def outcomes(self, request_id: str, attempt: int, ranks) -> dict[int, ShardOutcome] | None:  # noqa: ANN001
        return None

    def forget(self, request_id: str, attempt: int) -> None:
        return None

    def checksums(self, block_ids, groups, corrupt_rank=None) -> list[tuple[int, ...]]:  # noqa: ANN001
        return []


def test_a_follower_that_never_reports_fails_the_transfer_past_its_deadline(workers) -> None:
    clock = ManualClock()
    sender = NixlKVSender(workers.prefill0, clock=clock, shards=_SilentFollower(workers.prefill1.handshake_info()))
    plan = TransferPlan.create("req-silent", [1, 2], [3, 4], now=clock(), timeout_s=5.0)
    transfer = sender.start(workers.peer, plan)
    assert transfer.state is TransferState.TRANSFERRING and sender.poll() == []
    clock.advance(5.0 + 5.0)  # the deadline and the followers' grace to report
    assert sender.poll() == [transfer] and transfer.state is TransferState.FAILED
    assert transfer.reason == "rank 1 failed: no report of its WRITE's end"
